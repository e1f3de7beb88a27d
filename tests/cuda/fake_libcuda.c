/* A CPU stand-in for the libcuda entry points kvflow.cuda binds (tests/cuda/test_driver.py).
 *
 * Contexts are per thread, as in CUDA; every call that needs one fails with
 * CUDA_ERROR_INVALID_CONTEXT (201) when none is current. Copies really copy (host
 * addresses), so a test sees that pointers and sizes travel unchanged through ctypes.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void *ptr;
static __thread ptr current;
static __thread ptr stack[16];
static __thread int depth;
static ptr stream_ctx[64];
static int streams, events, records, waits;
static unsigned last_event_flags;

#define CTX(dev) ((ptr)(uintptr_t)(0xC0000 + 0x1000 * (dev)))
#define STREAM(i) ((ptr)(uintptr_t)(0x5000 + (i)))

int cuInit(unsigned flags) { return flags ? 1 : 0; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal + 100; return 0; }
int cuDevicePrimaryCtxRetain(ptr *ctx, int dev) { *ctx = CTX(dev - 100); return 0; }
int cuCtxGetCurrent(ptr *ctx) { *ctx = current; return 0; }
int cuCtxSetCurrent(ptr ctx) { current = ctx; return 0; }
int cuCtxPushCurrent_v2(ptr ctx) { stack[depth++] = current; current = ctx; return 0; }
int cuCtxPopCurrent_v2(ptr *ctx) {
    if (!depth) return 201;
    *ctx = current;
    current = stack[--depth];
    return 0;
}
int cuStreamCreate(ptr *stream, unsigned flags) {
    if (!current || flags != 1) return current ? 1 : 201;
    stream_ctx[streams] = current;
    *stream = STREAM(streams++);
    return 0;
}
int cuStreamDestroy_v2(ptr stream) { (void)stream; return 0; }
int cuStreamGetCtx(ptr stream, ptr *ctx) {
    uintptr_t i = (uintptr_t)stream - 0x5000;
    if ((uintptr_t)stream < 0x5000 || i >= (uintptr_t)streams) return 400;
    *ctx = stream_ctx[i];
    return 0;
}
int cuStreamWaitEvent(ptr stream, ptr event, unsigned flags) {
    (void)stream; (void)event;
    if (!current) return 201;
    waits++;
    return flags ? 1 : 0;
}
int cuEventCreate(ptr *event, unsigned flags) {
    if (!current) return 201;
    last_event_flags = flags;
    *event = (ptr)(uintptr_t)(0xE000 + events++);
    return 0;
}
int cuEventDestroy_v2(ptr event) { (void)event; return 0; }
int cuEventRecord(ptr event, ptr stream) {
    (void)event; (void)stream;
    if (!current) return 201;
    records++;
    return 0;
}
int cuEventQuery(ptr event) { return ((uintptr_t)event & 1) ? 600 : 0; }
int cuEventElapsedTime(float *ms, ptr start, ptr end) {
    (void)start;
    if ((uintptr_t)end & 1) return 600;
    *ms = 1.5f;
    return 0;
}
int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, ptr stream) {
    (void)stream;
    if (!current) return 201;
    if (n > ((size_t)1 << 30)) return 1;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return 0;
}
/* CUDA_MEMCPY2D (v2); only unified addresses (memory type 4) are taken, as kvflow passes */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    uint64_t srcDevice;
    ptr srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    uint64_t dstDevice;
    ptr dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} Memcpy2D;
int cuMemcpy2DAsync_v2(const Memcpy2D *c, ptr stream) {
    (void)stream;
    if (!current) return 201;
    if (c->srcMemoryType != 4 || c->dstMemoryType != 4 || c->srcPitch < c->WidthInBytes
        || c->dstPitch < c->WidthInBytes || c->srcXInBytes || c->srcY || c->dstXInBytes || c->dstY)
        return 1;
    for (size_t row = 0; row < c->Height; row++)
        memcpy((void *)(uintptr_t)(c->dstDevice + row * c->dstPitch),
               (const void *)(uintptr_t)(c->srcDevice + row * c->srcPitch), c->WidthInBytes);
    return 0;
}
static int priority[64];
int cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    if (!current) return 201;
    *least = 0;
    *greatest = -5;
    return 0;
}
int cuStreamSetAttribute(ptr stream, int attr, const int *value) {
    int i = (int)((uintptr_t)stream - 0x5000);
    if (attr != 8 || i < 0 || i >= streams) return 1;
    priority[i] = value[0];
    return 0;
}
int cuStreamGetPriority(ptr stream, int *value) {
    int i = (int)((uintptr_t)stream - 0x5000);
    if (i < 0 || i >= streams) return 1;
    *value = priority[i];
    return 0;
}
int cuLaunchHostFunc(ptr stream, ptr fn, ptr data) { (void)stream; (void)fn; (void)data; return 0; }
int cuGetErrorName(int code, const char **name) {
    switch (code) {
    case 1: *name = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 201: *name = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
    case 600: *name = "CUDA_ERROR_NOT_READY"; return 0;
    default: return 1;
    }
}

/* what the test reads back */
int fake_depth(void) { return depth; }
int fake_records(void) { return records; }
int fake_waits(void) { return waits; }
unsigned fake_last_event_flags(void) { return last_event_flags; }
