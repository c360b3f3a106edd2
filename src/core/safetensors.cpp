#include "expertqmm/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "core/input_file.h"
#include "core/json.h"
#include "expertqmm/error.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors stores little-endian data; this reader assumes a little-endian host"
#endif

namespace expertqmm {

namespace {

constexpr const char* kOp = "safetensors";
// The reference implementation's limit; a larger header is a corrupt length, not a checkpoint.
constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;
constexpr size_t kMaxRank = 32;

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw Error(kOp, path + ": " + what); }
[[noreturn]] void fail_tensor(const std::string& path, const std::string& name, const std::string& what) {
  fail(path, "tensor '" + name + "': " + what);
}

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypes[] = {
    {"BF16", DType::bf16}, {"F16", DType::f16}, {"F32", DType::f32}, {"U32", DType::u32}, {"I32", DType::i32}, {"U8", DType::u8}};

const char* safetensors_dtype_name(DType t) {
  for (const DTypeName& d : kDTypes)
    if (d.dtype == t) return d.name;
  return nullptr;
}

// A read-only file mapping; pages are MAP_PRIVATE, so a write through a tensor view stays private
// to the process instead of faulting or reaching the file. The descriptor stays open so that the
// file's size can be checked again before its tensors are handed out: a file truncated while it is
// mapped turns every read past its new end into SIGBUS.
struct Mapping {
  void* addr = MAP_FAILED;
  size_t size = 0;
  int fd = -1;
  ~Mapping() {
    if (addr != MAP_FAILED) ::munmap(addr, size);
    if (fd >= 0) ::close(fd);
  }
};

std::string errno_text() { return std::strerror(errno); }

std::string range_str(size_t b, size_t e) { return detail::cat("[", b, ", ", e, ")"); }

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;

  detail::InputFile file(path, kOp);
  const uint64_t file_size = file.size();
  if (file_size < 8)
    fail(path, detail::cat("file is ", file_size, " bytes, shorter than the 8-byte header length"));
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(file_size);
  mapping->addr = ::mmap(nullptr, mapping->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, file.fd(), 0);
  if (mapping->addr == MAP_FAILED) fail(path, "cannot mmap: " + errno_text());
  mapping->fd = file.release();
  const unsigned char* base = static_cast<const unsigned char*>(mapping->addr);

  uint64_t header_len;
  std::memcpy(&header_len, base, 8);
  if (header_len > kMaxHeaderBytes)
    fail(path, detail::cat("header length ", header_len, " is absurd (limit ", kMaxHeaderBytes, " bytes)"));
  if (header_len > file_size - 8)
    fail(path, detail::cat("header length ", header_len, " runs past the end of the file (", file_size,
                           " bytes)"));
  const size_t data_size = static_cast<size_t>(file_size - 8 - header_len);

  json::Value root;
  try {
    root = json::parse(std::string_view(reinterpret_cast<const char*>(base + 8), header_len));
  } catch (const Error& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!root.is_object())
    fail(path, std::string("header must be a JSON object, got a ") + json::Value::kind_name(root.kind()));

  // The parser rejects duplicate keys (tensor names, '__metadata__', fields), so each is seen once.
  for (const auto& [name, value] : root.members()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail(path, "'__metadata__' must be an object of strings");
      for (const auto& [key, v] : value.members()) {
        if (!v.is_string()) fail(path, "'__metadata__' value of '" + key + "' is not a string");
        f.metadata_.emplace(key, v.as_string());
      }
      continue;
    }
    if (!value.is_object())
      fail_tensor(path, name, std::string("entry must be an object, got a ") + json::Value::kind_name(value.kind()));
    for (const auto& member : value.members())
      if (member.first != "dtype" && member.first != "shape" && member.first != "data_offsets")
        fail_tensor(path, name, "unknown field '" + member.first + "'");
    const json::Value* dtype = value.find("dtype");
    const json::Value* shape = value.find("shape");
    const json::Value* offsets = value.find("data_offsets");
    if (!dtype || !shape || !offsets) fail_tensor(path, name, "needs 'dtype', 'shape' and 'data_offsets'");

    Entry e;
    if (!dtype->is_string()) fail_tensor(path, name, "'dtype' must be a string");
    bool known = false;
    for (const DTypeName& d : kDTypes)
      if (dtype->as_string() == d.name) {
        e.dtype = d.dtype;
        known = true;
      }
    if (!known)
      fail_tensor(path, name, "unsupported dtype '" + dtype->as_string() + "' (supported: BF16, F16, F32, U32, I32, U8)");

    if (!shape->is_array()) fail_tensor(path, name, "'shape' must be an array of non-negative integers");
    if (shape->items().size() > kMaxRank)
      fail_tensor(path, name, detail::cat("shape has ", shape->items().size(), " dims (limit ", kMaxRank, ")"));
    // bytes: the data size; extent: the same with zero dims counted as 1, which the strides of a
    // tensor holding nothing still multiply (Tensor's limit: int64).
    uint64_t bytes = dtype_size(e.dtype), extent = bytes;
    bool overflow = false;
    for (const json::Value& d : shape->items()) {
      uint64_t dim;
      if (!d.to_uint64(&dim) || dim > static_cast<uint64_t>(INT64_MAX))
        fail_tensor(path, name, "'shape' must be an array of non-negative integers");
      e.shape.push_back(static_cast<int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(bytes, dim, &bytes) ||
                 __builtin_mul_overflow(extent, dim ? dim : 1, &extent) || extent > uint64_t(INT64_MAX);
    }
    if (overflow) fail_tensor(path, name, "shape " + shape_str(e.shape) + " is too large");

    uint64_t begin, end;
    if (!offsets->is_array() || offsets->items().size() != 2 || !offsets->items()[0].to_uint64(&begin) ||
        !offsets->items()[1].to_uint64(&end))
      fail_tensor(path, name, "'data_offsets' must be two non-negative integers [begin, end]");
    if (begin > end) fail_tensor(path, name, detail::cat("data_offsets [", begin, ", ", end, "] end before they begin"));
    if (end > data_size)
      fail_tensor(path, name, detail::cat("data_offsets [", begin, ", ", end, "] run past the data section (",
                                          data_size, " bytes)"));
    if (end - begin != bytes)
      fail_tensor(path, name, detail::cat("data_offsets [", begin, ", ", end, "] hold ", end - begin, " bytes but ",
                                          dtype->as_string(), shape_str(e.shape), " needs ", bytes));
    e.begin = static_cast<size_t>(begin);
    e.end = static_cast<size_t>(end);
    f.entries_.emplace(name, std::move(e));
  }

  // No two tensors may share a byte (empty tensors read nothing and are left out).
  std::vector<std::pair<const std::string*, const Entry*>> by_offset;
  for (const auto& [name, e] : f.entries_)
    if (e.end > e.begin) by_offset.emplace_back(&name, &e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const Entry& prev = *by_offset[i - 1].second;
    const Entry& cur = *by_offset[i].second;
    if (cur.begin < prev.end)
      fail_tensor(path, *by_offset[i].first,
                  "bytes " + range_str(cur.begin, cur.end) + " overlap tensor '" + *by_offset[i - 1].first + "' " +
                      range_str(prev.begin, prev.end));
  }

  for (const auto& entry : f.entries_) f.names_.push_back(entry.first);
  f.data_ = base + 8 + header_len;
  f.data_offset_ = 8 + header_len;
  f.mapping_ = std::move(mapping);
  return f;
}

void SafetensorsFile::check_size(size_t end) const {
  const auto* mapping = static_cast<const Mapping*>(mapping_.get());
  struct stat st;
  if (::fstat(mapping->fd, &st) != 0) fail(path_, "cannot stat: " + errno_text());
  const uint64_t now = static_cast<uint64_t>(st.st_size);
  if (now < data_offset_ + end)
    fail(path_, detail::cat("file shrank from ", mapping->size, " to ", now,
                            " bytes since it was opened (truncated while in use?); its tensors can no longer be read"));
}

Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) fail(path_, "no tensor named '" + name + "'");
  const Entry& e = it->second;
  check_size(e.end);  // a view past the file's end would kill the first reader with SIGBUS
  const unsigned char* ptr = data_ + e.begin;
  if (reinterpret_cast<uintptr_t>(ptr) % dtype_size(e.dtype) != 0)  // misaligned: element reads would be UB
    return Tensor::from_host(ptr, e.shape, e.dtype, Device::cpu);
  return Tensor::view_owned(const_cast<unsigned char*>(ptr), e.shape, e.dtype, Device::cpu, mapping_);
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  auto valid_utf8 = [](const std::string& s) {
    try {
      json::parse(json::quote(s));
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) fail(path, "tensor names must not be empty");
    if (name == "__metadata__") fail(path, "'__metadata__' is reserved and cannot name a tensor");
    if (!valid_utf8(name)) fail(path, "tensor name is not valid UTF-8");
    if (!seen.insert(name).second) fail_tensor(path, name, "duplicate tensor name");
    if (!t.defined()) fail_tensor(path, name, "tensor is undefined");
    if (!safetensors_dtype_name(t.dtype())) fail_tensor(path, name, "unsupported dtype");
  }
  for (const auto& [key, value] : metadata)
    if (!valid_utf8(key) || !valid_utf8(value)) fail(path, "metadata key '" + key + "' or its value is not valid UTF-8");

  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      header += (first ? "" : ",") + json::quote(key) + ":" + json::quote(value);
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (header.size() > 1) header += ",";
    header += json::quote(name) + ":{\"dtype\":\"" + safetensors_dtype_name(t.dtype()) + "\",\"shape\":[";
    for (int i = 0; i < t.ndim(); ++i) header += (i ? "," : "") + std::to_string(t.size(i));
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.nbytes()) + "]}";
    offset += t.nbytes();
  }
  header += "}";
  // Pad with spaces so the data section starts 8-byte aligned (as the reference writer does).
  while ((8 + header.size()) % 8 != 0) header += ' ';

  const std::string tmp = path + ".tmp";
  FILE* out = std::fopen(tmp.c_str(), "wb");
  if (!out) fail(path, "cannot create '" + tmp + "': " + errno_text());
  bool ok = true;
  try {
    const uint64_t header_len = header.size();
    ok = ok && std::fwrite(&header_len, 8, 1, out) == 1;
    ok = ok && std::fwrite(header.data(), 1, header.size(), out) == header.size();
    for (const auto& entry : tensors) {
      if (!ok) break;
      const std::vector<uint8_t> bytes = entry.second.to_host_bytes();
      ok = bytes.empty() || std::fwrite(bytes.data(), 1, bytes.size(), out) == bytes.size();
    }
  } catch (...) {  // e.g. a device tensor that cannot be copied: leave no temp file behind
    std::fclose(out);
    std::remove(tmp.c_str());
    throw;
  }
  const std::string write_error = ok ? "" : errno_text();
  const bool closed = std::fclose(out) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    fail(path, "write failed: " + (ok ? errno_text() : write_error));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    std::remove(tmp.c_str());
    fail(path, "cannot rename '" + tmp + "' into place: " + why);
  }
}

}  // namespace expertqmm
