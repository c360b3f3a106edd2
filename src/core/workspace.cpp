#include "core/device_memory.h"
#include "core/workspace_slots.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"

static_assert(expertqmm::detail::kSlotCount == 16, "Workspace holds 16 slots (include/expertqmm/moe.h)");

namespace expertqmm {

Workspace::Workspace() = default;

Workspace::~Workspace() {
  for (Slot& s : slots_)
    if (s.ptr) detail::device_free(s.ptr);
}

bool Workspace::grow(Slot& s, size_t bytes) {
  if (bytes <= s.bytes) return false;
  if (s.ptr) detail::device_free(s.ptr);
  s.ptr = nullptr;
  s.bytes = 0;
  // Round up so that small growth does not reallocate every call.
  const size_t want = bytes < 4096 ? 4096 : bytes + bytes / 4;
  s.ptr = detail::device_alloc(want);
  s.bytes = want;
  return true;
}

Workspace::Slot& Workspace::slot_at(int slot) {
  EXPERTQMM_CHECK(slot >= 0 && slot < detail::kSlotCount, "Workspace", "slot ", slot, " out of range [0, ",
                  detail::kSlotCount, ")");
  return slots_[slot];
}

void* Workspace::get(int slot, size_t bytes) {
  Slot& s = slot_at(slot);
  grow(s, bytes);
  return s.ptr;
}

void* Workspace::get_zeroed(int slot, size_t bytes) {
  Slot& s = slot_at(slot);
  if (grow(s, bytes)) detail::device_zero(s.ptr, s.bytes);
  return s.ptr;
}

Workspace& Workspace::branch() {
  if (!branch_) branch_ = std::make_unique<Workspace>();
  return *branch_;
}

size_t Workspace::bytes_held() const {
  size_t n = branch_ ? branch_->bytes_held() : 0;
  for (const Slot& s : slots_) n += s.bytes;
  return n;
}

}  // namespace expertqmm
