/* onnxkv/_kernels/run_delay.h -- how long the calling thread has waited for a
 * core: the late-team heuristic's signal of more runnable threads than cores
 * (_runtime.pyx, okv_team_threads). */
#ifndef ONNXKV_RUN_DELAY_H
#define ONNXKV_RUN_DELAY_H

#include <stdint.h>
#if defined(__linux__)
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
#endif

/* Nanoseconds the calling thread has spent runnable but waiting for a core
 * (the run-queue delay of /proc/thread-self/schedstat, Linux with scheduler
 * statistics); -1 where the OS cannot say.  Three system calls: read it
 * once per window of work, not per call. */
static inline long long okv_thread_run_delay(void) {
#if defined(__linux__)
    char buf[96];
    unsigned long long cpu = 0, delay = 0;
    ssize_t n;
    int flags = O_RDONLY, fd;
#ifdef O_CLOEXEC /* POSIX 2008: absent from a strict C99 compile, where the short-lived descriptor goes without */
    flags |= O_CLOEXEC;
#endif
    fd = open("/proc/thread-self/schedstat", flags);
    if (fd < 0) return -1;
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    if (sscanf(buf, "%llu %llu", &cpu, &delay) != 2) return -1;
    return (long long)delay;
#else
    return -1;
#endif
}

/* An id of the calling thread (0 where the OS cannot say): run-queue delays of two threads are not
 * comparable. */
static inline uint64_t okv_thread_id(void) {
#if defined(__linux__)
    return (uint64_t)pthread_self();
#else
    return 0;
#endif
}

#endif /* ONNXKV_RUN_DELAY_H */
