/* Placeholder: replaced by the real extension (see native/README.md). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&mod); }
