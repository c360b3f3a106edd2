// A small strict JSON parser (RFC 8259) for untrusted checkpoint headers. Strict: no comments, no
// trailing commas, no leading zeros, no NaN/Infinity, strings must be valid UTF-8 without raw control
// characters, no duplicate keys in an object (readers disagree on which value wins: Python's json
// takes the last, others the first). Bounded: nesting deeper than `max_depth` is an error, never a
// stack overflow.
// Every failure throws expertqmm::Error("json", "at byte <offset>: <what>").
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace expertqmm::json {

class Value {
 public:
  enum class Kind : uint8_t { null, boolean, number, string, array, object };

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::null; }
  bool is_bool() const { return kind_ == Kind::boolean; }
  bool is_number() const { return kind_ == Kind::number; }
  bool is_string() const { return kind_ == Kind::string; }
  bool is_array() const { return kind_ == Kind::array; }
  bool is_object() const { return kind_ == Kind::object; }

  bool as_bool() const;                  // throws unless a boolean
  const std::string& as_string() const;  // throws unless a string
  // The number as written, e.g. "-1.5e3" (numbers keep their text so that 64-bit integers are exact).
  const std::string& number_text() const;
  // True and *out set when the number is a plain non-negative integer that fits in uint64
  // (no sign, fraction or exponent); false for every other value, numbers included.
  bool to_uint64(uint64_t* out) const;

  // Array items; object members in the order written (keys are unique).
  const std::vector<Value>& items() const;
  const std::vector<std::pair<std::string, Value>>& members() const;
  // The member named `key`, or nullptr (objects only; nullptr for other kinds).
  const Value* find(std::string_view key) const;

  static const char* kind_name(Kind k);

 private:
  friend class Parser;
  Kind kind_ = Kind::null;
  bool bool_ = false;
  std::string text_;  // string contents or number text
  std::vector<Value> items_;
  std::vector<std::pair<std::string, Value>> members_;
};

constexpr int kDefaultMaxDepth = 64;

// Parses exactly one JSON value surrounded by optional whitespace.
Value parse(std::string_view text, int max_depth = kDefaultMaxDepth);

// Writes `s` as a JSON string literal (quotes included), escaping '"', '\\' and control characters.
std::string quote(std::string_view s);

}  // namespace expertqmm::json
