/* Module stub only: the kernels are plain C functions that powerinfer/ops loads through ctypes.
 * Defining PyInit__kernels lets setuptools build the library as the extension powerinfer._kernels. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels", "powerinfer CPU kernels (ctypes)",
                                            -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
