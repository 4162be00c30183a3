// Errors inside the library: thrown as C++ exceptions, turned into status codes at the ABI boundary.
#pragma once
#include <stdexcept>
#include <string>

namespace tinyknn {

// A caller mistake that Python should have caught (reported as TK_INVALID_ARGUMENT -> ValueError).
struct InvalidArgument : std::invalid_argument {
  explicit InvalidArgument(const std::string& what) : std::invalid_argument(what) {}
};

inline void require(bool condition, const char* message) {
  if (!condition) throw InvalidArgument(message);
}

}  // namespace tinyknn
