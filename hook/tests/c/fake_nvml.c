/* A fake libnvidia-ml.so.1 over the fake GPU of fake_gpu.h: the compute processes are those
 * that created a context; a process's SM utilization is its busy share of the time since the
 * previous query. Only what tessera-cuda-hook calls. */
#include <string.h>
#include "fake_gpu.h"

typedef int nvmlReturn_t;
struct sample { unsigned pid; unsigned long long ts; unsigned sm, mem, enc, dec; };
struct pinfo { unsigned pid; unsigned long long mem; unsigned gi, ci; };
struct util { unsigned gpu, memory; };

static uint64_t last_ns, last_busy[FAKE_MAX_PROCS], last_total;

nvmlReturn_t nvmlInit_v2(void) { return 0; }
nvmlReturn_t nvmlInit(void) { return 0; }
nvmlReturn_t nvmlShutdown(void) { return 0; }
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **dev) {
    if (strncmp(uuid, "GPU-", 4)) return 2; /* INVALID_ARGUMENT */
    *dev = (void *)0x1;
    return 0;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *dev, unsigned *n, struct pinfo *out) {
    (void)dev;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    unsigned have = g->nprocs;
    if (*n < have) { *n = have; fake_unlock(g); return 7; }
    for (unsigned i = 0; i < have; i++) { memset(&out[i], 0, sizeof out[i]); out[i].pid = g->pids[i]; }
    *n = have;
    fake_unlock(g);
    return 0;
}
nvmlReturn_t nvmlDeviceGetProcessUtilization(void *dev, struct sample *out, unsigned *n, unsigned long long since) {
    (void)dev; (void)since;
    struct fake_gpu *g = fake_gpu();
    if (!out) { *n = g->nprocs ? g->nprocs : 1; return 7; }
    fake_lock(g);
    uint64_t now = fake_now_ns();
    uint64_t dt = last_ns ? now - last_ns : 0;
    unsigned k = 0;
    for (unsigned i = 0; i < g->nprocs && k < *n; i++, k++) {
        uint64_t busy = g->busy_ns[i] - last_busy[i];
        last_busy[i] = g->busy_ns[i];
        out[k].pid = g->pids[i];
        out[k].ts = now / 1000;
        out[k].sm = dt ? (unsigned)(busy * 100 / dt) : 0;
        if (out[k].sm > 100) out[k].sm = 100;
        out[k].mem = out[k].enc = out[k].dec = 0;
    }
    last_ns = now;
    fake_unlock(g);
    *n = k;
    return 0;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(void *dev, struct util *u) {
    (void)dev;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    uint64_t now = fake_now_ns();
    uint64_t dt = last_ns ? now - last_ns : 0;
    u->gpu = dt ? (unsigned)((g->busy_total_ns - last_total) * 100 / dt) : 0;
    if (u->gpu > 100) u->gpu = 100;
    last_total = g->busy_total_ns;
    last_ns = now;
    fake_unlock(g);
    u->memory = 0;
    return 0;
}
