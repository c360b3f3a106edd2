#include "core/device_memory.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"

namespace expertqmm {

Workspace::Workspace() = default;

Workspace::~Workspace() {
  for (Slot& s : slots_)
    if (s.ptr) detail::device_free(s.ptr);
}

void* Workspace::get(int slot, size_t bytes) {
  EXPERTQMM_CHECK(slot >= 0 && slot < static_cast<int>(sizeof(slots_) / sizeof(slots_[0])), "Workspace",
                  "slot ", slot, " out of range");
  Slot& s = slots_[slot];
  if (bytes > s.bytes) {
    if (s.ptr) detail::device_free(s.ptr);
    s.ptr = nullptr;
    s.bytes = 0;
    // Round up so that small growth does not reallocate every call.
    size_t want = bytes < 4096 ? 4096 : bytes + bytes / 4;
    s.ptr = detail::device_alloc(want);
    s.bytes = want;
  }
  return s.ptr;
}

size_t Workspace::bytes_held() const {
  size_t n = 0;
  for (const Slot& s : slots_) n += s.bytes;
  return n;
}

}  // namespace expertqmm
