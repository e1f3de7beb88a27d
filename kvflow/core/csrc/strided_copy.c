/*
 * kvflow strided copies: np.copyto for two arrays of one shape and item size, each
 * contiguous run copied in 256-byte vector blocks (streamed from 128 KiB), with the GIL
 * released.
 *
 * The CPU mover copies between a host KV pool and L1 chunks through strided views: an
 * SGLang `page_first` page is token-major and a kvflow chunk layer-major, so a copy is
 * runs of one row (2 KiB for 8 heads of 128 fp16 values) at 16-64 KiB strides. numpy's
 * strided loop, and glibc's memcpy of one run, moved that at 5.5-6 GB/s on one 2-core
 * host (glibc's `rep movsb` path) and this loop's vector moves at 9.5; a large copy's
 * streaming stores reach 10-10.5 on one core and 18-24 on two (docs/SGLANG.md, Cost of
 * the extra hop).
 *
 * copyto(dst, src) reads both through the buffer protocol (shape, strides, item size;
 * any exporter with strides, numpy arrays included), refuses shapes or item sizes that
 * differ, a read-only dst and buffers whose byte ranges overlap (ValueError naming what),
 * then merges the innermost axes both store contiguously into one run and copies
 * run by run in index order, each in 256-byte blocks, or streamed (STREAM_BYTES).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* the most axes a copy may have (the mover's views have six) */
#define MAX_AXES 16

/* The lowest and one past the highest byte a strided buffer covers (empty: lo == hi). */
static void byte_range(const Py_buffer *view, char **lo, char **hi) {
    char *low = view->buf, *high = view->buf;
    for (int axis = 0; axis < view->ndim; axis++) {
        if (view->shape[axis] == 0) {
            *lo = *hi = view->buf;
            return;
        }
        Py_ssize_t span = (view->shape[axis] - 1) * view->strides[axis];
        if (span < 0) {
            low += span;
        } else {
            high += span;
        }
    }
    *lo = low;
    *hi = high + view->itemsize;
}

/* A buffer's shape as a tuple (NULL with an exception set if it cannot be made). */
static PyObject *shape_of(const Py_buffer *view) {
    PyObject *shape = PyTuple_New(view->ndim);
    for (int axis = 0; shape != NULL && axis < view->ndim; axis++) {
        PyObject *size = PyLong_FromSsize_t(view->shape[axis]);
        if (size == NULL) {
            Py_CLEAR(shape);
            break;
        }
        PyTuple_SET_ITEM(shape, axis, size);
    }
    return shape;
}

/* 1 if the two buffers agree in shape and item size; else 0 with ValueError set. */
static int same_shape(const Py_buffer *dst, const Py_buffer *src) {
    if (dst->itemsize != src->itemsize) {
        PyErr_Format(PyExc_ValueError, "copyto: items of %zd bytes (dst) and %zd bytes (src)",
                     dst->itemsize, src->itemsize);
        return 0;
    }
    int same = dst->ndim == src->ndim;
    for (int axis = 0; same && axis < dst->ndim; axis++) {
        same = dst->shape[axis] == src->shape[axis];
    }
    if (!same) {
        PyObject *dst_shape = shape_of(dst), *src_shape = shape_of(src);
        if (dst_shape != NULL && src_shape != NULL) {
            PyErr_Format(PyExc_ValueError, "copyto: dst has shape %R, src %R", dst_shape,
                         src_shape);
        }
        Py_XDECREF(dst_shape);
        Py_XDECREF(src_shape);
        return 0;
    }
    if (dst->ndim > MAX_AXES) {
        PyErr_Format(PyExc_ValueError, "copyto: %d axes, at most %d", dst->ndim, MAX_AXES);
        return 0;
    }
    return 1;
}

/* Bytes a run is copied in (the tail by memcpy). glibc's memcpy moves runs of 2 KiB and
 * more with `rep movsb`, which some hosts (AMD EPYC here) run at 6 GB/s where vector moves
 * reach 9.5 (2 KiB runs at 16 KiB strides, one core); the compiler turns a copy of a
 * constant 256 bytes into vector moves. */
#define BLOCK 256

static inline void copy_run(char *dst, const char *src, size_t run) {
    size_t at = 0;
    for (; at + BLOCK <= run; at += BLOCK) {
        __builtin_memcpy(dst + at, src + at, BLOCK);
    }
    if (at < run) {
        memcpy(dst + at, src + at, run - at);
    }
}

/* Copies of this many bytes or more write with non-temporal (streaming) stores where the
 * CPU has them: a copy this large leaves the caches anyway, and a streaming store skips
 * reading each destination line before writing it (a third of the memory traffic). One
 * core, 2 KiB runs, 64 MiB: gathering 8.7 -> 10.3 GB/s, scattering 9.3 -> 14.6; two
 * cores 14.5 -> 18.5 and 15.3 -> 23.5 (the 2-core box, docs/SGLANG.md). */
#define STREAM_BYTES (128 * 1024)

#if defined(__SSE2__)
/* copy_run with streaming stores; `dst` is 16-byte aligned. */
static inline void stream_run(char *dst, const char *src, size_t run) {
    size_t at = 0;
    for (; at + 64 <= run; at += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + at));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + at + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + at + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + at + 48));
        _mm_stream_si128((__m128i *)(dst + at), a);
        _mm_stream_si128((__m128i *)(dst + at + 16), b);
        _mm_stream_si128((__m128i *)(dst + at + 32), c);
        _mm_stream_si128((__m128i *)(dst + at + 48), d);
    }
    if (at < run) {
        memcpy(dst + at, src + at, run - at);
    }
}
#endif

/* Copy `outer` axes (shape, byte strides of each side) of runs of `run` bytes; `stream`:
 * with streaming stores (every run's dst 16-byte aligned), fenced before returning. */
static void copy_runs(char *dst, char *src, int outer, const Py_ssize_t *shape,
                      const Py_ssize_t *dst_strides, const Py_ssize_t *src_strides,
                      size_t run, int stream) {
    Py_ssize_t index[MAX_AXES] = {0};
    for (;;) {
#if defined(__SSE2__)
        if (stream) {
            stream_run(dst, src, run);
        } else {
            copy_run(dst, src, run);
        }
#else
        (void)stream;
        copy_run(dst, src, run);
#endif
        int axis = outer - 1;
        for (; axis >= 0; axis--) {  /* the next index, last axis fastest */
            dst += dst_strides[axis];
            src += src_strides[axis];
            if (++index[axis] < shape[axis]) {
                break;
            }
            dst -= dst_strides[axis] * shape[axis];
            src -= src_strides[axis] * shape[axis];
            index[axis] = 0;
        }
        if (axis < 0) {
            break;
        }
    }
#if defined(__SSE2__)
    if (stream) {
        _mm_sfence(); /* the streamed lines are visible before the copy is reported done */
    }
#endif
}

/* Whether a copy of `nbytes` in runs of `run` bytes streams: large enough, runs of whole
 * 64-byte steps, and every run's dst 16-byte aligned (its start and each outer stride). */
static int streams(const Py_buffer *dst, int outer, size_t run, size_t nbytes) {
#if defined(__SSE2__)
    if (nbytes < STREAM_BYTES || run < 64 || (uintptr_t)dst->buf % 16) {
        return 0;
    }
    for (int axis = 0; axis < outer; axis++) {
        if (dst->strides[axis] % 16) {
            return 0;
        }
    }
    return 1;
#else
    (void)dst, (void)outer, (void)run, (void)nbytes;
    return 0;
#endif
}

/* Reorder the outer axes, largest source stride outermost (a stable sort), so a streamed
 * copy reads its source in address order and scatters its writes, which streaming stores
 * take at full speed: the CPU mover's gather of 256-byte runs (SGLang's `page_head` pages
 * into layer-major chunks) went from 10-13 to 16-29 GB/s on two cores (docs/SGLANG.md).
 * No two runs overlap, so any order copies the same bytes. */
static inline Py_ssize_t magnitude(Py_ssize_t stride) { return stride < 0 ? -stride : stride; }

static void in_source_order(int outer, Py_ssize_t *shape, Py_ssize_t *dst_strides,
                            Py_ssize_t *src_strides) {
    for (int i = 1; i < outer; i++) {
        Py_ssize_t n = shape[i], d = dst_strides[i], s = src_strides[i];
        int j = i;
        for (; j > 0 && magnitude(src_strides[j - 1]) < magnitude(s); j--) {
            shape[j] = shape[j - 1];
            dst_strides[j] = dst_strides[j - 1];
            src_strides[j] = src_strides[j - 1];
        }
        shape[j] = n;
        dst_strides[j] = d;
        src_strides[j] = s;
    }
}

static PyObject *copyto(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) {
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    if (!same_shape(&dst, &src)) {
        goto done;
    }
    char *dst_lo, *dst_hi, *src_lo, *src_hi;
    byte_range(&dst, &dst_lo, &dst_hi);
    byte_range(&src, &src_lo, &src_hi);
    if (dst_lo == dst_hi) {  /* nothing to copy */
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (dst_lo < src_hi && src_lo < dst_hi) {
        PyErr_SetString(PyExc_ValueError, "copyto: dst and src overlap");
        goto done;
    }
    /* the innermost axes both sides store contiguously become one run */
    int outer = dst.ndim;
    size_t run = (size_t)dst.itemsize;
    while (outer > 0 && dst.strides[outer - 1] == (Py_ssize_t)run &&
           src.strides[outer - 1] == (Py_ssize_t)run) {
        run *= (size_t)dst.shape[outer - 1];
        outer--;
    }
    size_t nbytes = run;
    for (int axis = 0; axis < outer; axis++) {
        nbytes *= (size_t)dst.shape[axis];
    }
    int stream = streams(&dst, outer, run, nbytes);
    Py_ssize_t shape[MAX_AXES], dst_strides[MAX_AXES], src_strides[MAX_AXES];
    for (int axis = 0; axis < outer; axis++) {
        shape[axis] = dst.shape[axis];
        dst_strides[axis] = dst.strides[axis];
        src_strides[axis] = src.strides[axis];
    }
    if (stream) {
        in_source_order(outer, shape, dst_strides, src_strides);
    }
    Py_BEGIN_ALLOW_THREADS
    copy_runs(dst.buf, src.buf, outer, shape, dst_strides, src_strides, run, stream);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"copyto", copyto, METH_VARARGS,
     "copyto(dst, src): copy src into dst (one shape and item size, no overlap), run by "
     "contiguous run, without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvflow_copy", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kvflow_copy(void) { return PyModule_Create(&module); }
