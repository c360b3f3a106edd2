// Internal side of include/expertqmm/diagnostics.h: what the route selector records, and the hook
// that folds retractions decided on the device into snapshot() without core code touching CUDA.
#pragma once
#include <cstdint>

#include "expertqmm/diagnostics.h"

namespace expertqmm::detail {

// gather_qmm: the expert tile route vs the generic routes. moe_decode_layer: the three-kernel decode
// layer vs the general moe_layer_into path (a "hit" is a layer served by the decode kernels).
// gather_mm: the 16-bit expert tile route vs the GEMV and simt routes. dense_mlp_glu: the Gemma 4
// block's dense MLP with gate, up and the GLU product in one launch (the decode GLU kernel, qmv's
// GeGLU epilogue, or the wgmma tile kernel's GLU form on T rows of one expert) vs two linears and
// the GLU kernel (not requested: the separate product mode).
enum class Primitive : uint8_t { gather_qmm, moe_decode_layer, gather_mm, dense_mlp_glu, count_ };
constexpr int kPrimitiveCount = static_cast<int>(Primitive::count_);
const char* primitive_name(Primitive p);

// One call that reached the selector. `hit`: served by the expert tile route (then `why` is
// ignored); otherwise `why` is the one fallback class that sent it to the generic route. A hit must
// be requested and available; a miss is `disabled` exactly when not requested. Violations throw
// Error (they are selector bugs) and count nothing. Relaxed atomics: safe from any thread.
void record_selection(Primitive p, bool requested, bool available, bool hit, Fallback why);

// Reads the device-side count of retracted tile plans of primitive `p` (each of which the selector had
// recorded as a hit) and zeroes it when `reset` is true. snapshot() calls it with false and moves
// that many counts from hits to fallbacks[sortedness_retracted]; reset() calls it with true.
// nullptr unregisters. The reader may synchronize the device.
using DeviceRetractionReader = uint64_t (*)(bool reset);
void set_device_retraction_reader(DeviceRetractionReader read_and_reset, Primitive p = Primitive::gather_qmm);

}  // namespace expertqmm::detail
