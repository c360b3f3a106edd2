// The one exception type of expertqmm: it names the op and carries the offending values.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace expertqmm {

class Error : public std::runtime_error {
 public:
  Error(std::string op, const std::string& message)
      : std::runtime_error("expertqmm::" + op + ": " + message), op_(std::move(op)) {}
  const std::string& op() const { return op_; }

 private:
  std::string op_;
};

namespace detail {
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}
}  // namespace detail

// EXPERTQMM_CHECK(cond, op, parts...): throw Error(op, cat(parts...)) unless cond.
#define EXPERTQMM_CHECK(cond, op, ...)                                            \
  do {                                                                            \
    if (!(cond)) throw ::expertqmm::Error((op), ::expertqmm::detail::cat(__VA_ARGS__)); \
  } while (0)

}  // namespace expertqmm
