// The extension's argument checks: TW_CHECK(cond, parts...) raises as TORCH_CHECK does, with the
// message built here, numbers formatted by std::to_string rather than an iostream (on the GPU
// image, 2026-12-04, a TORCH_CHECK message that streamed an integer ended the process with a
// segmentation fault inside the op instead of raising; text alone raised). The parts are
// evaluated only when the check fails.
#pragma once

#include <c10/util/Exception.h>

#include <ostream>
#include <string>
#include <type_traits>
#include <utility>

namespace tokenweave {
namespace detail {

template <typename T, typename = void>
struct Streams : std::false_type {};  // an operator<< of its own (torch's dtype prints its name)
template <typename T>
struct Streams<T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<T>())>>
    : std::true_type {};

template <typename T>
void append_part(std::string& s, const T& v) {
  if constexpr (std::is_convertible_v<const T&, const char*> ||
                std::is_same_v<T, std::string>) {
    s += v;
  } else if constexpr (std::is_same_v<T, bool>) {
    s += v ? "true" : "false";
  } else if constexpr (std::is_integral_v<T> || std::is_floating_point_v<T>) {
    s += std::to_string(v);
  } else if constexpr (std::is_enum_v<T> && !Streams<T>::value) {
    s += std::to_string(static_cast<std::underlying_type_t<T>>(v));
  } else {
    s += c10::str(v);  // torch's types (dtype, device): their own names
  }
}

}  // namespace detail

template <typename... Parts>
std::string check_message(const Parts&... parts) {
  std::string s;
  (detail::append_part(s, parts), ...);
  return s;
}

}  // namespace tokenweave

#define TW_CHECK(cond, ...) TORCH_CHECK(cond, ::tokenweave::check_message(__VA_ARGS__))
