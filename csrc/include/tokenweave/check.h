// The extension's argument checks: TW_CHECK(cond, parts...) raises as TORCH_CHECK does, with the
// message built here, numbers by std::to_string or snprintf, no iostream (on the GPU image,
// 2026-12-04, a TORCH_CHECK message that streamed an integer ended the process with a
// segmentation fault inside the op instead of raising; text alone raised). The parts are
// evaluated only when the check fails.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace tokenweave {
namespace detail {

template <typename T>
void append_part(std::string& s, const T& v) {
  if constexpr (std::is_same_v<T, char>) {
    s += v;
  } else if constexpr (std::is_convertible_v<const T&, const char*>) {
    const char* text = v;
    s += text != nullptr ? text : "(null)";
  } else if constexpr (std::is_same_v<T, std::string>) {
    s += v;
  } else if constexpr (std::is_same_v<T, bool>) {
    s += v ? "1" : "0";  // as TORCH_CHECK prints it
  } else if constexpr (std::is_integral_v<T>) {
    s += std::to_string(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", static_cast<double>(v));
    s += text;
  } else if constexpr (std::is_same_v<T, c10::ScalarType>) {
    s += c10::toString(v);  // the dtype's name
  } else if constexpr (std::is_enum_v<T>) {
    s += std::to_string(static_cast<std::underlying_type_t<T>>(v));
  } else {
    static_assert(std::is_convertible_v<T, std::string>,
                  "TW_CHECK message parts: text, numbers, enums, at::ScalarType");
    s += std::string(v);
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
