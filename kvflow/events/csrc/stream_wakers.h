/*
 * kvflow stream wakers: the ring of native CUDA host functions that wake the event bus
 * (stream_wakers.c). Declared here for the Python extension (stream_lanes.c) that drives it.
 */
#ifndef KVF_STREAM_WAKERS_H
#define KVF_STREAM_WAKERS_H

#include <stdint.h>

/* cuLaunchHostFunc(CUstream, CUhostFn, void *) and cuStreamWaitEvent(CUstream, CUevent,
 * unsigned): both return a CUresult, 0 = success. */
typedef int (*kvf_launch_fn)(void *stream, void (*fn)(void *), void *user_data);
typedef int (*kvf_wait_fn)(void *stream, void *event, unsigned int flags);

typedef struct kvf_ring kvf_ring;

kvf_ring *kvf_ring_create(uint32_t capacity, int wake_fd, kvf_launch_fn launch, kvf_wait_fn wait);
int kvf_ring_arm(kvf_ring *ring, uint32_t index, void *stream, void *event);
uint32_t kvf_ring_drain(kvf_ring *ring, uint32_t *out, uint32_t max);
void kvf_ring_wake(kvf_ring *ring);
void kvf_ring_release(kvf_ring *ring);
void kvf_wake(void *user_data);
int64_t kvf_live_ring_count(void);

#endif
