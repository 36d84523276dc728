// The Python extension module `fastamp._C`. It exposes nothing itself: importing it loads this
// shared library, whose static initialisers run the TORCH_LIBRARY registrations of every
// capability.
#include <Python.h>

static PyModuleDef fastamp_module = {
    PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C(void) {
  return PyModule_Create(&fastamp_module);
}
