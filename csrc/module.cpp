// The Python extension module `fastamp._C`. It exposes nothing itself: importing it loads this
// shared library, whose static initialisers run the STABLE_TORCH_LIBRARY registrations of every
// capability.
// Python's limited API (3.10 and up; CMake's USE_SABI defines it): the library is an abi3 module,
// one file for every CPython.
#ifndef Py_LIMITED_API
#error "csrc/module.cpp must be built with Py_LIMITED_API (Python_add_library ... USE_SABI 3.10)"
#endif
#include <Python.h>

static PyModuleDef fastamp_module = {
    PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C(void) {
  return PyModule_Create(&fastamp_module);
}
