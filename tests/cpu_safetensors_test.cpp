// The safetensors reader/writer and the strict JSON parser under it: round trips of every dtype,
// and every kind of malformed file gives an expertqmm::Error (files written to a temp dir).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/json.h"
#include "expertqmm/error.h"
#include "expertqmm/safetensors.h"
#include "support/test_util.h"

using namespace expertqmm;
namespace fs = std::filesystem;

namespace {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "expertqmm_st_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

// A file with the given header text and `data_bytes` zero bytes of data.
std::string st_file(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

std::vector<uint8_t> bytes_of(const Tensor& t) { return t.to_host_bytes(); }

// ---------------------------------------------------------------------------------------------
TEST(Safetensors, RoundTripOfEveryDtype) {
  TempDir dir;
  const std::string path = dir.file("all.safetensors");
  const Tensor bf = test::random_tensor({2, 3}, DType::bf16);
  const Tensor h = test::random_tensor({5}, DType::f16);
  const Tensor f = test::random_tensor({2, 2, 2}, DType::f32);
  std::vector<uint32_t> u(15);
  for (size_t i = 0; i < u.size(); ++i) u[i] = 0x9E3779B9u * static_cast<uint32_t>(i + 1);
  const Tensor u32 = Tensor::from_host(u.data(), {3, 5}, DType::u32);
  const int32_t scalar_value = -123456;
  const Tensor i32 = Tensor::from_host(&scalar_value, {}, DType::i32);
  const Tensor empty = Tensor::empty({0, 3}, DType::i32);
  const Tensor base = test::random_tensor({4, 3}, DType::f32);
  const Tensor strided = Tensor::view(base.data(), {3, 4}, DType::f32, Device::cpu, {1, 3});
  const std::map<std::string, std::string> meta = {{"format", "mlx"}, {"note", "quote \" backslash \\ newline \n \xc3\xbc"}};

  save_safetensors(path,
                   {{"z.bf16", bf}, {"f16", h}, {"f32", f}, {"u32", u32}, {"scalar", i32}, {"empty", empty},
                    {"strided", strided}},
                   meta);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"empty", "f16", "f32", "scalar", "strided", "u32", "z.bf16"}));
  EXPECT_EQ(file.metadata(), meta);
  EXPECT_TRUE(file.has("u32"));
  EXPECT_FALSE(file.has("nope"));
  struct Expect {
    const char* name;
    const Tensor* t;
  };
  for (Expect e : {Expect{"z.bf16", &bf}, Expect{"f16", &h}, Expect{"f32", &f}, Expect{"u32", &u32},
                   Expect{"scalar", &i32}, Expect{"empty", &empty}, Expect{"strided", &strided}}) {
    SCOPED_TRACE(e.name);
    const Tensor got = file.get(e.name);
    EXPECT_EQ(got.dtype(), e.t->dtype());
    EXPECT_EQ(got.shape(), e.t->shape());
    EXPECT_EQ(got.device(), Device::cpu);
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_EQ(bytes_of(got), bytes_of(*e.t));  // strided input is written row-major
  }

  // The data section starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ((8 + header_len) % 8, 0u);
}

TEST(Safetensors, TensorsAreViewsThatKeepTheMappingAlive) {
  TempDir dir;
  const std::string path = dir.file("keep.safetensors");
  const Tensor f = test::random_tensor({64, 32}, DType::f32);
  save_safetensors(path, {{"w", f}});
  Tensor view;
  {
    const SafetensorsFile file = SafetensorsFile::open(path);
    view = file.get("w");
    EXPECT_EQ(file.get("w").data(), view.data()) << "get() must return a view, not a copy";
  }  // the SafetensorsFile is gone; the view still owns the mapping
  EXPECT_EQ(bytes_of(view), bytes_of(f));
  // Writes through a view stay private to the process (MAP_PRIVATE), never reaching the file.
  view.data_as<float>()[0] = 12345.0f;
  EXPECT_EQ(bytes_of(SafetensorsFile::open(path).get("w")), bytes_of(f));
}

// A tensor whose offset is not a multiple of its element size is copied out, aligned.
TEST(Safetensors, MisalignedTensorIsReadCorrectly) {
  TempDir dir;
  const std::string path = dir.file("misaligned.safetensors");
  const std::string header =
      "{\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,2]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[2,10]}}";
  std::string data(10, '\0');
  const float vals[2] = {1.5f, -2.25f};
  std::memcpy(data.data() + 2, vals, 8);
  write_bytes(path, le64(header.size()) + header + data);
  const SafetensorsFile file = SafetensorsFile::open(path);
  const Tensor b = file.get("b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4, 0u);
  EXPECT_EQ(test::to_float(b), (std::vector<float>{1.5f, -2.25f}));
}

// ---------------------------------------------------------------------------------------------
// Malformed files: an Error("safetensors") naming the file, and the tensor where there is one.
void expect_open_error(const std::string& path, const std::string& fragment) {
  try {
    SafetensorsFile::open(path);
    ADD_FAILURE() << "opened a malformed file; expected an error mentioning '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "safetensors") << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << "error must name the file: " << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

struct BadHeader {
  const char* label;
  std::string header;
  size_t data_bytes;
  const char* fragment;  // expected in the message
};

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":" + dtype + ",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}

TEST(Safetensors, MalformedHeadersAreErrors) {
  const std::string ok_a = entry("a", "\"F32\"", "[2]", "[0,8]");
  const std::vector<BadHeader> cases = {
      {"not json", "hello", 0, "not valid JSON"},
      {"empty header", "", 0, "not valid JSON"},
      {"array root", "[1,2]", 0, "must be a JSON object"},
      {"truncated json", "{\"a\":", 0, "not valid JSON"},
      {"trailing garbage", "{} x", 0, "trailing"},
      {"depth bomb", "{\"a\":" + std::string(10000, '[') + std::string(10000, ']') + "}", 0, "nesting"},
      {"entry not an object", "{\"a\":5}", 0, "tensor 'a': entry must be an object"},
      {"unsupported dtype", "{" + entry("a", "\"F64\"", "[1]", "[0,8]") + "}", 8, "tensor 'a': unsupported dtype 'F64'"},
      {"dtype not a string", "{" + entry("a", "4", "[1]", "[0,4]") + "}", 4, "tensor 'a': 'dtype'"},
      {"negative dim", "{" + entry("a", "\"F32\"", "[-1]", "[0,4]") + "}", 4, "tensor 'a': 'shape'"},
      {"fractional dim", "{" + entry("a", "\"F32\"", "[1.5]", "[0,4]") + "}", 4, "tensor 'a': 'shape'"},
      {"exponent dim", "{" + entry("a", "\"F32\"", "[1e2]", "[0,400]") + "}", 400, "tensor 'a': 'shape'"},
      {"string shape", "{" + entry("a", "\"F32\"", "\"3\"", "[0,12]") + "}", 12, "tensor 'a': 'shape'"},
      {"dim beyond int64", "{" + entry("a", "\"F32\"", "[18446744073709551615]", "[0,4]") + "}", 4,
       "tensor 'a': 'shape'"},
      {"overflowing shape", "{" + entry("a", "\"F32\"", "[4611686018427387904,4]", "[0,4]") + "}", 4,
       "tensor 'a': shape [4611686018427387904, 4] is too large"},
      {"missing shape", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "tensor 'a': needs"},
      {"unknown field", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4,
       "tensor 'a': unknown field 'x'"},
      {"offsets reversed", "{" + entry("a", "\"F32\"", "[0]", "[8,4]") + "}", 8, "tensor 'a': data_offsets [8, 4]"},
      {"one offset", "{" + entry("a", "\"F32\"", "[1]", "[4]") + "}", 4, "tensor 'a': 'data_offsets'"},
      {"three offsets", "{" + entry("a", "\"F32\"", "[1]", "[0,4,8]") + "}", 8, "tensor 'a': 'data_offsets'"},
      {"negative offset", "{" + entry("a", "\"F32\"", "[1]", "[-4,0]") + "}", 4, "tensor 'a': 'data_offsets'"},
      {"offsets past the data", "{" + entry("a", "\"F32\"", "[4]", "[0,16]") + "}", 8,
       "tensor 'a': data_offsets [0, 16] run past the data section (8 bytes)"},
      {"huge offsets", "{" + entry("a", "\"F32\"", "[1]", "[18446744073709551612,18446744073709551615]") + "}", 8,
       "tensor 'a': data_offsets"},
      {"offsets disagree with the shape", "{" + entry("a", "\"F32\"", "[3]", "[0,8]") + "}", 8,
       "tensor 'a': data_offsets [0, 8] hold 8 bytes but F32[3] needs 12"},
      {"overlapping ranges", "{" + ok_a + "," + entry("b", "\"F32\"", "[2]", "[4,12]") + "}", 12,
       "tensor 'b': bytes [4, 12) overlap tensor 'a' [0, 8)"},
      {"duplicate names", "{" + ok_a + "," + entry("a", "\"F32\"", "[2]", "[8,16]") + "}", 16,
       "duplicate key \"a\""},
      {"duplicate field", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"shape\":[1]}}", 8,
       "duplicate key \"shape\""},
      {"duplicate metadata", "{\"__metadata__\":{}," + ok_a + ",\"__metadata__\":{}}", 8,
       "duplicate key \"__metadata__\""},
      {"duplicate metadata key", "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}," + ok_a + "}", 8,
       "duplicate key \"k\""},
      {"zero-sized shape with overflowing strides",
       "{" + entry("a", "\"F32\"", "[0,4611686018427387904,4611686018427387904]", "[0,0]") + "}", 0,
       "tensor 'a': shape [0, 4611686018427387904, 4611686018427387904] is too large"},
      {"metadata not an object", "{\"__metadata__\":[1]," + ok_a + "}", 8, "'__metadata__' must be an object"},
      {"metadata value not a string", "{\"__metadata__\":{\"k\":1}," + ok_a + "}", 8,
       "'__metadata__' value of 'k' is not a string"},
      {"invalid utf-8 name", "{\"\xff\":{}}", 0, "UTF-8"},
      {"raw control character", "{\"a\nb\":{}}", 0, "control character"},
  };
  TempDir dir;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].label);
    const std::string path = dir.file("bad" + std::to_string(i) + ".safetensors");
    write_bytes(path, st_file(cases[i].header, cases[i].data_bytes));
    expect_open_error(path, cases[i].fragment);
  }
}

TEST(Safetensors, TruncatedAndAbsurdFilesAreErrors) {
  TempDir dir;
  const std::string missing = dir.file("missing.safetensors");
  expect_open_error(missing, "cannot open");
  expect_open_error(dir.path().string(), "is a directory, not a file");

  const std::string empty = dir.file("empty.safetensors");
  write_bytes(empty, "");
  expect_open_error(empty, "file is 0 bytes, shorter than the 8-byte header length");
  const std::string seven = dir.file("seven.safetensors");
  write_bytes(seven, std::string(7, '\x01'));
  expect_open_error(seven, "file is 7 bytes");

  const std::string past = dir.file("past.safetensors");
  write_bytes(past, le64(100) + "{}");
  expect_open_error(past, "header length 100 runs past the end of the file (10 bytes)");
  const std::string absurd = dir.file("absurd.safetensors");
  write_bytes(absurd, le64(uint64_t(1) << 63) + "{}");
  expect_open_error(absurd, "is absurd");

  // A valid file cut short: the data section no longer holds the tensor.
  const std::string whole = dir.file("whole.safetensors");
  save_safetensors(whole, {{"w", test::random_tensor({16}, DType::f32)}});
  const std::string cut = dir.file("cut.safetensors");
  const auto size = fs::file_size(whole);
  fs::copy_file(whole, cut);
  fs::resize_file(cut, size - 4);
  expect_open_error(cut, "tensor 'w': data_offsets [0, 64] run past the data section (60 bytes)");
}

TEST(Safetensors, MissingTensorIsAnError) {
  TempDir dir;
  const std::string path = dir.file("one.safetensors");
  save_safetensors(path, {{"w", test::random_tensor({2}, DType::f32)}});
  const SafetensorsFile file = SafetensorsFile::open(path);
  try {
    file.get("v");
    ADD_FAILURE() << "no error for a missing tensor";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "safetensors");
    EXPECT_NE(std::string(e.what()).find("no tensor named 'v'"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, BadSaveArgumentsAreErrors) {
  TempDir dir;
  const Tensor t = test::random_tensor({2}, DType::f32);
  const std::string path = dir.file("out.safetensors");
  auto expect_save_error = [&](const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& p,
                               const std::string& fragment) {
    try {
      save_safetensors(p, tensors);
      ADD_FAILURE() << "no error; expected one mentioning '" << fragment << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), "safetensors");
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_save_error({{"a", t}, {"a", t}}, path, "tensor 'a': duplicate tensor name");
  expect_save_error({{"", t}}, path, "must not be empty");
  expect_save_error({{"__metadata__", t}}, path, "reserved");
  expect_save_error({{"a", Tensor()}}, path, "tensor 'a': tensor is undefined");
  expect_save_error({{"\xff", t}}, path, "UTF-8");
  expect_save_error({{"a", t}}, dir.file("no/such/dir/out.safetensors"), "cannot create");
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir.path())) << "a failed save must leave no file behind";
}

// ---------------------------------------------------------------------------------------------
TEST(Json, ParsesTheFullGrammar) {
  const json::Value v = json::parse(
      " {\"a\": [1, -0, 2.5e-3, 1E+2, true, false, null], \"s\": \"q\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\","
      " \"o\": {}, \"e\": []} \r\n");
  ASSERT_TRUE(v.is_object());
  ASSERT_EQ(v.members().size(), 4u);
  EXPECT_EQ(v.find("a")->items().size(), 7u);
  EXPECT_EQ(v.find("a")->items()[2].number_text(), "2.5e-3");
  EXPECT_TRUE(v.find("a")->items()[4].as_bool());
  EXPECT_TRUE(v.find("a")->items()[6].is_null());
  EXPECT_EQ(v.find("s")->as_string(), "q\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(v.find("o")->is_object());
  EXPECT_TRUE(v.find("e")->is_array());
  EXPECT_EQ(v.find("missing"), nullptr);
  EXPECT_THROW(v.find("s")->items(), Error);  // wrong kind
}

TEST(Json, Uint64IsExactAndBounded) {
  uint64_t x = 0;
  EXPECT_TRUE(json::parse("18446744073709551615").to_uint64(&x));
  EXPECT_EQ(x, UINT64_MAX);
  EXPECT_TRUE(json::parse("9007199254740993").to_uint64(&x));  // 2^53 + 1: not a double
  EXPECT_EQ(x, 9007199254740993ull);
  EXPECT_FALSE(json::parse("18446744073709551616").to_uint64(&x));  // overflow
  EXPECT_FALSE(json::parse("-1").to_uint64(&x));
  EXPECT_FALSE(json::parse("1.0").to_uint64(&x));
  EXPECT_FALSE(json::parse("1e3").to_uint64(&x));
  EXPECT_FALSE(json::parse("\"1\"").to_uint64(&x));
}

TEST(Json, RejectsEverythingOutsideTheGrammar) {
  const char* bad[] = {"",          " ",        "{",          "}",        "[1,]",      "{\"a\":1,}", "{a:1}",
                       "{'a':1}",   "01",       "-",          "1.",       ".5",        "1e",         "+1",
                       "NaN",       "Infinity", "tru",        "nul",      "\"abc",     "\"\\x\"",    "\"\\u12\"",
                       "\"\\ud800\"", "\"\\udc00\"", "\"\\ud800\\u0041\"", "[1 2]", "{\"a\" 1}", "// c\n{}",
                       "{} {}",     "\"\xc0\xaf\"", "\"\xed\xa0\x80\"", "\"\xf4\x90\x80\x80\"", "\"\xe2\x82\"",
                       "\"\x01\""};
  for (const char* text : bad) {
    SCOPED_TRACE(text);
    try {
      json::parse(text);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), "json");
    }
  }
}

// Python's json takes the last of two equal keys and a first-match lookup the first: a duplicate is
// an error, in small objects, large ones (hashed), nested ones, and when an escape spells the key.
TEST(Json, DuplicateKeysAreErrors) {
  std::string large = "{";
  for (int i = 0; i < 40; ++i) large += "\"k" + std::to_string(i) + "\":" + std::to_string(i) + ",";
  EXPECT_EQ(json::parse(large + "\"last\":0}").members().size(), 41u);
  const std::string cases[] = {"{\"a\":1,\"a\":2}", "{\"a\":1,\"b\":2,\"a\":1}", "[{\"x\":{\"y\":1,\"y\":1}}]",
                               "{\"a\":1,\"\\u0061\":2}", large + "\"k0\":0}", large + "\"k39\":0}"};
  for (const std::string& text : cases) {
    SCOPED_TRACE(text);
    try {
      json::parse(text);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("duplicate key"), std::string::npos) << e.what();
    }
  }
}

TEST(Json, DepthIsBounded) {
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_NO_THROW(json::parse(nested(json::kDefaultMaxDepth)));
  EXPECT_THROW(json::parse(nested(json::kDefaultMaxDepth + 1)), Error);
  EXPECT_THROW(json::parse(nested(1000000)), Error);  // no stack overflow
  EXPECT_THROW(json::parse(nested(3), 2), Error);
}

TEST(Json, QuoteRoundTrips) {
  const std::string s = std::string("a\"b\\c\n\t\x01\x1f z \xc3\xbc") + std::string(1, '\0');
  EXPECT_EQ(json::parse(json::quote(s)).as_string(), s);
}

}  // namespace
