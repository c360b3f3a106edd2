// Route selector counters (include/expertqmm/diagnostics.h, src/core/route_counters.h).
#include <algorithm>
#include <atomic>
#include <iomanip>
#include <sstream>

#include "core/route_counters.h"
#include "expertqmm/error.h"

namespace expertqmm {

namespace {
// attempts is not stored: snapshot() derives it as hits + sum(fallbacks), so the invariant holds
// even in a snapshot taken while other threads record.
struct AtomicCounters {
  std::atomic<uint64_t> requested{0}, available{0}, hits{0};
  std::atomic<uint64_t> fallbacks[kFallbackCount] = {};
};

AtomicCounters& counters(detail::Primitive p) {
  static AtomicCounters all[detail::kPrimitiveCount];
  return all[static_cast<int>(p)];
}

std::atomic<detail::DeviceRetractionReader> g_retraction_readers[detail::kPrimitiveCount] = {};
}  // namespace

const char* fallback_name(Fallback f) {
  switch (f) {
    case Fallback::disabled: return "disabled";
    case Fallback::dtype: return "dtype";
    case Fallback::quantization: return "quantization";
    case Fallback::topology: return "topology";
    case Fallback::shape: return "shape";
    case Fallback::alignment: return "alignment";
    case Fallback::sortedness_retracted: return "sortedness_retracted";
    case Fallback::count_: break;
  }
  throw Error("fallback_name", detail::cat("value ", static_cast<int>(f), " is not a Fallback (valid: 0..",
                                           kFallbackCount - 1, ")"));
}

uint64_t RouteCounters::fallback_total() const {
  uint64_t total = 0;
  for (uint64_t f : fallbacks) total += f;
  return total;
}

namespace detail {

const char* primitive_name(Primitive p) {
  switch (p) {
    case Primitive::gather_qmm: return "gather_qmm";
    case Primitive::moe_decode_layer: return "moe_decode_layer";
    case Primitive::gather_mm: return "gather_mm";
    case Primitive::dense_mlp_glu: return "dense_mlp_glu";
    case Primitive::count_: break;
  }
  throw Error("primitive_name", cat("value ", static_cast<int>(p), " is not a Primitive"));
}

void record_selection(Primitive p, bool requested, bool available, bool hit, Fallback why) {
  constexpr const char* op = "record_selection";
  EXPERTQMM_CHECK(static_cast<int>(p) < kPrimitiveCount, op, "primitive ",
                  static_cast<int>(p), " out of range");
  if (hit) {
    EXPERTQMM_CHECK(requested && available, op, primitive_name(p), ": a hit must be requested and available (requested=",
                    requested, ", available=", available, ")");
  } else {
    EXPERTQMM_CHECK(static_cast<int>(why) < kFallbackCount, op, primitive_name(p),
                    ": fallback ", static_cast<int>(why), " out of range");
    EXPERTQMM_CHECK((why == Fallback::disabled) == !requested, op, primitive_name(p), ": fallback '",
                    fallback_name(why), "' with requested=", requested,
                    " (a miss is 'disabled' exactly when the route was not requested)");
  }
  AtomicCounters& c = counters(p);
  constexpr auto relaxed = std::memory_order_relaxed;
  if (requested) c.requested.fetch_add(1, relaxed);
  if (available) c.available.fetch_add(1, relaxed);
  if (hit)
    c.hits.fetch_add(1, relaxed);
  else
    c.fallbacks[static_cast<int>(why)].fetch_add(1, relaxed);
}

void set_device_retraction_reader(DeviceRetractionReader read_and_reset, Primitive p) {
  EXPERTQMM_CHECK(static_cast<int>(p) < kPrimitiveCount, "set_device_retraction_reader", "primitive ",
                  static_cast<int>(p), " out of range");
  g_retraction_readers[static_cast<int>(p)].store(read_and_reset);
}

}  // namespace detail

namespace diagnostics {

std::vector<RouteCounters> snapshot() {
  constexpr auto relaxed = std::memory_order_relaxed;
  std::vector<RouteCounters> out;
  for (int i = 0; i < detail::kPrimitiveCount; ++i) {
    const auto p = static_cast<detail::Primitive>(i);
    AtomicCounters& c = counters(p);
    RouteCounters r;
    r.primitive = detail::primitive_name(p);
    r.requested = c.requested.load(relaxed);
    r.available = c.available.load(relaxed);
    r.hits = c.hits.load(relaxed);
    for (int f = 0; f < kFallbackCount; ++f) r.fallbacks[f] = c.fallbacks[f].load(relaxed);
    {
      if (detail::DeviceRetractionReader reader = g_retraction_readers[i].load()) {
        // Each device retraction was recorded as a hit; clamped in case work queued before a
        // reset() retracted after it (its hit is gone, so there is nothing to move).
        const uint64_t moved = std::min(reader(false), r.hits);
        r.hits -= moved;
        r.fallbacks[static_cast<int>(Fallback::sortedness_retracted)] += moved;
      }
    }
    r.attempts = r.hits + r.fallback_total();
    out.push_back(r);
  }
  return out;
}

void reset() {
  constexpr auto relaxed = std::memory_order_relaxed;
  for (int i = 0; i < detail::kPrimitiveCount; ++i) {
    AtomicCounters& c = counters(static_cast<detail::Primitive>(i));
    c.requested.store(0, relaxed);
    c.available.store(0, relaxed);
    c.hits.store(0, relaxed);
    for (auto& f : c.fallbacks) f.store(0, relaxed);
  }
  for (auto& slot : g_retraction_readers)
    if (detail::DeviceRetractionReader reader = slot.load()) reader(true);
}

std::string format(const std::vector<RouteCounters>& counters) {
  std::vector<std::string> headers = {"primitive", "attempts", "requested", "available", "hits"};
  for (int f = 0; f < kFallbackCount; ++f) headers.push_back(fallback_name(static_cast<Fallback>(f)));
  std::vector<std::vector<std::string>> rows;
  for (const RouteCounters& c : counters) {
    std::vector<std::string> row = {c.primitive,
                                    std::to_string(c.attempts),
                                    std::to_string(c.requested),
                                    std::to_string(c.available),
                                    std::to_string(c.hits)};
    for (uint64_t f : c.fallbacks) row.push_back(std::to_string(f));
    rows.push_back(row);
  }
  std::vector<size_t> width(headers.size());
  for (size_t j = 0; j < headers.size(); ++j) {
    width[j] = headers[j].size();
    for (const auto& row : rows) width[j] = std::max(width[j], row[j].size());
  }
  // Primitive names left-aligned, numbers right-aligned; the fallback columns follow a bar.
  std::ostringstream s;
  auto emit = [&](const std::vector<std::string>& row) {
    for (size_t j = 0; j < row.size(); ++j) {
      if (j == 5) s << " |";
      s << (j == 0 ? std::left : std::right) << (j ? " " : "") << std::setw(static_cast<int>(width[j])) << row[j];
    }
    s << '\n';
  };
  emit(headers);
  for (const auto& row : rows) emit(row);
  return s.str();
}

}  // namespace diagnostics

}  // namespace expertqmm
