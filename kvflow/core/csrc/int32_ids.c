/*
 * kvflow id lists: Python ints to int32 in one C loop.
 *
 * Engines hand kvflow token ids as Python lists (vLLM's prompt token ids are one). A
 * 128k-token prompt is 128k int objects over ~4 MiB; the array module's converter reads
 * each through calls that check its type code and range, ~4x slower than this loop,
 * which reads a one-digit int's value in place (every token id is one) and prefetches
 * the objects ahead of the one it reads (docs/PERFORMANCE.md, RPC).
 *
 * int32_into(seq, out) fills the writable buffer `out` (4 bytes per item, native byte
 * order) from the list or tuple `seq` and returns -1, or returns the index of the first
 * item that is not an exact int within int32 (bools, numpy scalars and out-of-range
 * values included); the caller then converts the whole sequence another way, which
 * accepts or names it. The GIL is held throughout, so the sequence cannot change under
 * the loop (a free-threaded CPython turns the GIL back on when it imports a module that,
 * like this one, does not declare it safe without it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* how many items ahead of the one being read its object is prefetched */
#define PREFETCH_AHEAD 16

/* The value of a plain int of one digit (|value| < 2**30), read in place: 1, or 0 for a
 * longer int, which the caller converts through the C API. CPython 3.12 made the digit
 * count private and added the accessors used there; 3.11 keeps it in the object size. */
static inline int one_digit_value(PyObject *item, long *value) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        return 0;
    }
    *value = (long)PyUnstable_Long_CompactValue((PyLongObject *)item);
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size < -1 || size > 1) {
        return 0;
    }
    *value = (long)size * (long)((PyLongObject *)item)->ob_digit[0];
#endif
    return 1;
}

static PyObject *int32_into(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq, *out;
    if (!PyArg_ParseTuple(args, "OO", &seq, &out)) {
        return NULL;
    }
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "int32_into needs a list or a tuple, got %s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (view.len != n * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_Format(PyExc_ValueError, "int32_into: %zd items need %zd bytes, out has %zd", n,
                     n * (Py_ssize_t)sizeof(int32_t), view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int32_t *dst = view.buf;
    Py_ssize_t refused = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            __builtin_prefetch(items[i + PREFETCH_AHEAD]);
        }
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            refused = i;
            break;
        }
        long value;
        int overflow = 0;
        if (!one_digit_value(item, &value)) {
            value = PyLong_AsLongAndOverflow(item, &overflow);
        }
        if (overflow || value < INT32_MIN || value > INT32_MAX) {
            refused = i;
            break;
        }
        dst[i] = (int32_t)value;
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(refused);
}

static PyMethodDef methods[] = {
    {"int32_into", int32_into, METH_VARARGS,
     "int32_into(seq, out) -> -1, or the index of the first item that is no int32 int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvflow_ids", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kvflow_ids(void) { return PyModule_Create(&module); }
