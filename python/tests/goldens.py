"""The MLX goldens of tests/golden (written by MLX itself, tests/golden/make_*.py), read with numpy."""
import json
import os
import struct

import ml_dtypes
import numpy as np

GOLDEN_DIR = os.environ.get("EXPERTQMM_GOLDEN_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "golden")

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "U32": np.uint32, "I32": np.int32,
           "U8": np.uint8}


def load(name):
    """(tensors {name: numpy array}, metadata {key: str}) of tests/golden/<name>."""
    with open(os.path.join(GOLDEN_DIR, name), "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    tensors = {}
    for key, spec in header.items():
        begin, end = spec["data_offsets"]
        tensors[key] = np.frombuffer(data[begin:end], dtype=_DTYPES[spec["dtype"]]).reshape(spec["shape"])
    return tensors, meta


def cases(meta):
    """{case name: {param: value}} from the 'case.NAME' = 'k=v k=v' metadata entries."""
    out = {}
    for key, value in meta.items():
        if key.startswith("case."):
            out[key[5:]] = dict(kv.split("=", 1) for kv in value.split())
    return out


def rel_error(got, want):
    """||got - want|| / ||want|| in float64."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
