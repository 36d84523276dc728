// What lets one compiled library load on every Linux that torch's own wheels load on (glibc 2.28
// and the libstdc++ of GCC 8: the manylinux_2_28 policy) although it is built with a newer
// toolchain (this project's: Debian 12, glibc 2.36, GCC 12).
//
// The linker binds every call into glibc and libstdc++ to the newest version of the symbol that the
// build machine's libraries define. With GCC 12 and glibc 2.36 that made the library need, besides
// what glibc 2.28 and GCC 8's libstdc++ have (auditwheel show: manylinux_2_34):
//   pow@GLIBC_2.29                          (the optimizers' bias corrections)
//   dlsym@GLIBC_2.34                        (torch >= 2.14's stable headers look newer shim
//                                            functions up at run time: TORCH_DYNAMIC_VERSION_CALL)
//   __libc_single_threaded@GLIBC_2.32       (libstdc++'s headers: reference counts in std::string,
//                                            std::shared_ptr, locales)
//   std::__throw_bad_array_new_length()     GLIBCXX_3.4.29 (std::vector's allocator, GCC >= 11)
//   std::stringstream(), std::ostringstream()  GLIBCXX_3.4.26 (the default constructors, GCC >= 9;
//                                            torch's stable headers and fastamp's error messages)
// This file defines each of them inside the library (hidden: nothing is exported), on top of what
// glibc 2.28 and GCC 8's libstdc++ already provide, so the references bind here and the library
// needs nothing newer. It is what the manylinux images' gcc-toolset does with
// libstdc++_nonshared.a, for the few symbols this library uses, and with the compiler the rest of
// the project uses (the kernels' code is unchanged, bit for bit). The wheels are repaired with
// `auditwheel repair --plat manylinux_2_28_x86_64` (Makefile), which fails naming any symbol that
// needs more, so a new one cannot slip into a wheel.
//
// C++ objects still never cross into libtorch except the exceptions the stable ABI carries: the
// library keeps using the system's shared libstdc++ (the one torch loads), so there is one copy of
// the exception runtime in the process; a static libstdc++ would bring a second.
#include <ios>
#include <new>
#include <sstream>

// x86_64 glibc with libstdc++ (the C++11 string ABI, which torch's wheels use): the symbol versions
// below are that platform's.
#if defined(__linux__) && defined(__x86_64__) && defined(__GLIBC__) && defined(__GLIBCXX__) && \
    _GLIBCXX_USE_CXX11_ABI

// pow: glibc 2.29 gave pow a new version (the same computation without the SVID error-handling
// wrapper); the base version is in every glibc and computes the same value (errors aside: the
// library calls pow on finite bases and integer exponents).
extern "C" double fastamp_pow_glibc_2_2_5(double, double);
__asm__(".symver fastamp_pow_glibc_2_2_5,pow@GLIBC_2.2.5");

// dlsym: glibc 2.34 moved the dl* functions from libdl.so.2 into libc.so.6 under a new version. The
// base version is in libdl.so.2 before 2.34 (CMakeLists.txt makes the library need libdl.so.2, so
// it is loaded there) and in libc.so.6 from 2.34 on; the dynamic linker matches a versioned symbol
// in whichever of the two defines it.
extern "C" void* fastamp_dlsym_glibc_2_2_5(void*, const char*);
__asm__(".symver fastamp_dlsym_glibc_2_2_5,dlsym@GLIBC_2.2.5");

// libstdc++'s headers read glibc's "only one thread exists" flag (glibc >= 2.32) to skip atomic
// instructions. The library's own copy says "not single-threaded" at all times: the atomic path,
// always correct, and the one GCC 8's libstdc++ takes in a process with threads (torch's).
// The definitions take the symbols' names with asm labels (the C and C++ declarations of the
// same names in glibc's and libstdc++'s headers have default visibility); each does what glibc's or
// GCC 12's libstdc++'s does.
namespace fastamp::compat {

__attribute__((visibility("hidden"))) double pow_base_version(double x, double y) __asm__("pow");
double pow_base_version(double x, double y) {
  return fastamp_pow_glibc_2_2_5(x, y);
}

// dlsym finds the library that asks from its return address: the call below is a tail call (the
// caller's return address is kept), and either way both are inside this library.
__attribute__((visibility("hidden"))) void* dlsym_base_version(void* handle,
                                                               const char* name) __asm__("dlsym");
void* dlsym_base_version(void* handle, const char* name) {
  return fastamp_dlsym_glibc_2_2_5(handle, name);
}

__attribute__((visibility("hidden"))) char single_threaded __asm__("__libc_single_threaded") = 0;

[[noreturn]] __attribute__((visibility("hidden"))) void throw_bad_array_new_length() __asm__(
    "_ZSt28__throw_bad_array_new_lengthv");
void throw_bad_array_new_length() {
  throw std::bad_array_new_length();
}

__attribute__((visibility("hidden"))) void stringstream_ctor(void* self) __asm__(
    "_ZNSt7__cxx1118basic_stringstreamIcSt11char_traitsIcESaIcEEC1Ev");
void stringstream_ctor(void* self) {
  ::new (self) std::stringstream(std::ios_base::out | std::ios_base::in);
}

__attribute__((visibility("hidden"))) void ostringstream_ctor(void* self) __asm__(
    "_ZNSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEEC1Ev");
void ostringstream_ctor(void* self) {
  ::new (self) std::ostringstream(std::ios_base::out);
}

}  // namespace fastamp::compat

#endif
