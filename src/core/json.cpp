#include "core/json.h"

#include <unordered_set>

#include "expertqmm/error.h"

namespace expertqmm::json {

const char* Value::kind_name(Kind k) {
  switch (k) {
    case Kind::null: return "null";
    case Kind::boolean: return "boolean";
    case Kind::number: return "number";
    case Kind::string: return "string";
    case Kind::array: return "array";
    case Kind::object: return "object";
  }
  return "unknown";
}

static void expect_kind(const Value& v, Value::Kind k) {
  if (v.kind() != k)
    throw Error("json", detail::cat("expected a ", Value::kind_name(k), ", got a ", Value::kind_name(v.kind())));
}

bool Value::as_bool() const {
  expect_kind(*this, Kind::boolean);
  return bool_;
}
const std::string& Value::as_string() const {
  expect_kind(*this, Kind::string);
  return text_;
}
const std::string& Value::number_text() const {
  expect_kind(*this, Kind::number);
  return text_;
}
const std::vector<Value>& Value::items() const {
  expect_kind(*this, Kind::array);
  return items_;
}
const std::vector<std::pair<std::string, Value>>& Value::members() const {
  expect_kind(*this, Kind::object);
  return members_;
}

const Value* Value::find(std::string_view key) const {
  if (kind_ != Kind::object) return nullptr;
  for (const auto& m : members_)
    if (m.first == key) return &m.second;
  return nullptr;
}

bool Value::to_uint64(uint64_t* out) const {
  if (kind_ != Kind::number || text_.empty()) return false;
  uint64_t v = 0;
  for (char c : text_) {
    if (c < '0' || c > '9') return false;  // sign, fraction or exponent
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) return false;  // overflow
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

// Recursive descent over a byte range; `depth` counts open arrays/objects.
class Parser {
 public:
  Parser(std::string_view text, int max_depth) : s_(text), max_depth_(max_depth) {}

  Value parse_document() {
    skip_ws();
    Value v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected trailing characters after the JSON value");
    return v;
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  int max_depth_;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error("json", detail::cat("at byte ", pos_, ": ", what));
  }
  bool at_end() const { return pos_ >= s_.size(); }
  unsigned char peek() const { return static_cast<unsigned char>(s_[pos_]); }

  void skip_ws() {
    while (!at_end()) {
      const char c = s_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }

  void expect_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) fail(detail::cat("invalid literal, expected '", lit, "'"));
    pos_ += lit.size();
  }

  Value parse_value(int depth) {
    if (at_end()) fail("unexpected end of input, expected a value");
    Value v;
    switch (peek()) {
      case '{': return parse_object(depth + 1);
      case '[': return parse_array(depth + 1);
      case '"':
        v.kind_ = Value::Kind::string;
        v.text_ = parse_string();
        return v;
      case 't':
        expect_literal("true");
        v.kind_ = Value::Kind::boolean;
        v.bool_ = true;
        return v;
      case 'f':
        expect_literal("false");
        v.kind_ = Value::Kind::boolean;
        return v;
      case 'n':
        expect_literal("null");
        return v;
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
          v.kind_ = Value::Kind::number;
          v.text_ = parse_number();
          return v;
        }
        fail(detail::cat("unexpected character 0x", std::hex, static_cast<int>(peek())));
    }
  }

  void enter(int depth) {
    if (depth > max_depth_) fail(detail::cat("nesting deeper than ", max_depth_, " levels"));
  }

  Value parse_object(int depth) {
    enter(depth);
    ++pos_;  // '{'
    Value v;
    v.kind_ = Value::Kind::object;
    skip_ws();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return v;
    }
    std::unordered_set<std::string> keys;  // filled only for large objects; small ones scan members_
    while (true) {
      skip_ws();
      if (at_end() || peek() != '"') fail("expected a string key");
      const size_t key_at = pos_;
      std::string key = parse_string();
      if (is_duplicate(v.members_, keys, key)) {
        pos_ = key_at;
        fail("duplicate key " + quote(key) + " (readers disagree on which value wins)");
      }
      skip_ws();
      if (at_end() || peek() != ':') fail("expected ':' after an object key");
      ++pos_;
      skip_ws();
      Value item = parse_value(depth);
      v.members_.emplace_back(std::move(key), std::move(item));
      skip_ws();
      if (at_end()) fail("unterminated object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return v;
      }
      fail("expected ',' or '}' in an object");
    }
  }

  // Whether `key` is already a member; switches to the hash set once the object is large, so a
  // header of thousands of tensors stays linear.
  static bool is_duplicate(const std::vector<std::pair<std::string, Value>>& members,
                           std::unordered_set<std::string>& keys, const std::string& key) {
    constexpr size_t kScanLimit = 16;
    if (members.size() < kScanLimit) {
      for (const auto& m : members)
        if (m.first == key) return true;
      return false;
    }
    if (keys.empty())
      for (const auto& m : members) keys.insert(m.first);
    return !keys.insert(key).second;
  }

  Value parse_array(int depth) {
    enter(depth);
    ++pos_;  // '['
    Value v;
    v.kind_ = Value::Kind::array;
    skip_ws();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return v;
    }
    while (true) {
      skip_ws();
      v.items_.push_back(parse_value(depth));
      skip_ws();
      if (at_end()) fail("unterminated array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return v;
      }
      fail("expected ',' or ']' in an array");
    }
  }

  // number = [ "-" ] ( "0" / 1-9 *DIGIT ) [ "." 1*DIGIT ] [ ( "e" / "E" ) [ "+" / "-" ] 1*DIGIT ]
  std::string parse_number() {
    const size_t start = pos_;
    auto digit = [&] { return !at_end() && peek() >= '0' && peek() <= '9'; };
    if (peek() == '-') ++pos_;
    if (!digit()) fail("a number needs digits");
    if (peek() == '0') {
      ++pos_;
      if (digit()) fail("leading zeros are not allowed in numbers");
    } else {
      while (digit()) ++pos_;
    }
    if (!at_end() && peek() == '.') {
      ++pos_;
      if (!digit()) fail("a fraction needs digits");
      while (digit()) ++pos_;
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (!digit()) fail("an exponent needs digits");
      while (digit()) ++pos_;
    }
    return std::string(s_.substr(start, pos_ - start));
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t parse_hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else fail("invalid hex digit in \\u escape");
    }
    return v;
  }

  // Copies one well-formed UTF-8 sequence (RFC 3629: no overlongs, no surrogates, <= U+10FFFF).
  void copy_utf8_sequence(std::string& out) {
    const unsigned char c0 = peek();
    int len;
    uint32_t cp, min_cp;
    if (c0 >= 0xC2 && c0 <= 0xDF) { len = 2; cp = c0 & 0x1F; min_cp = 0x80; }
    else if (c0 >= 0xE0 && c0 <= 0xEF) { len = 3; cp = c0 & 0x0F; min_cp = 0x800; }
    else if (c0 >= 0xF0 && c0 <= 0xF4) { len = 4; cp = c0 & 0x07; min_cp = 0x10000; }
    else fail("invalid UTF-8 lead byte in a string");
    if (s_.size() - pos_ < static_cast<size_t>(len)) fail("truncated UTF-8 sequence in a string");
    for (int i = 1; i < len; ++i) {
      const unsigned char c = static_cast<unsigned char>(s_[pos_ + i]);
      if ((c & 0xC0) != 0x80) fail("invalid UTF-8 continuation byte in a string");
      cp = (cp << 6) | (c & 0x3F);
    }
    if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      fail("overlong or out-of-range UTF-8 sequence in a string");
    out.append(s_.data() + pos_, len);
    pos_ += len;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const unsigned char c = peek();
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("raw control character in a string");
      if (c >= 0x80) {
        copy_utf8_sequence(out);
        continue;
      }
      if (c != '\\') {
        out += static_cast<char>(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("lone low surrogate in \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.substr(pos_, 2) != "\\u") fail("high surrogate without a following low surrogate");
            pos_ += 2;
            const uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("high surrogate followed by a non-low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail(detail::cat("invalid escape '\\", e, "'"));
      }
    }
  }
};

Value parse(std::string_view text, int max_depth) { return Parser(text, max_depth).parse_document(); }

std::string quote(std::string_view s) {
  static const char* hex = "0123456789abcdef";
  std::string out = "\"";
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20) {
      out += "\\u00";
      out += hex[c >> 4];
      out += hex[c & 0xF];
    } else out += ch;
  }
  out += '"';
  return out;
}

}  // namespace expertqmm::json
