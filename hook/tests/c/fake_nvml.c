/* A fake libnvidia-ml.so.1 over the fake GPU of fake_gpu.h: the compute processes are those
 * that created a context, named by the pid each registered (its own getpid(): for clients in one
 * pid namespace, the pid the real 580 driver answers a query made in that namespace); a
 * process's SM utilization is its busy share of a sampling window. Only what tessera-cuda-hook
 * calls. */
#include <string.h>
#include "fake_gpu.h"

typedef int nvmlReturn_t;
struct sample { unsigned pid; unsigned long long ts; unsigned sm, mem, enc, dec; };
struct pinfo { unsigned pid; unsigned long long mem; unsigned gi, ci; };
struct util { unsigned gpu, memory; };

/* Per-process samples as the real driver keeps them (H100, driver 580): one per process every
 * $FAKE_NVML_SAMPLE_MS (default 200) ms, the busy share of that window; a query with no sample
 * newer than its `since` answers NOT_FOUND. */
static uint64_t window_ns, last_busy[FAKE_MAX_PROCS], card_ns, card_total;
static struct sample samples[FAKE_MAX_PROCS];
static unsigned nsamples;

static void sample(struct fake_gpu *g) {
    const char *p = getenv("FAKE_NVML_SAMPLE_MS");
    uint64_t period = (uint64_t)(p ? atoll(p) : 200) * 1000000ull;
    uint64_t now = fake_now_ns();
    if (window_ns && now - window_ns < period) return;
    uint64_t dt = window_ns ? now - window_ns : 0;
    nsamples = 0;
    for (unsigned i = 0; i < g->nprocs; i++) {
        uint64_t busy = g->busy_ns[i] - last_busy[i];
        last_busy[i] = g->busy_ns[i];
        if (!dt) continue;
        struct sample *s = &samples[nsamples++];
        s->pid = g->pids[i];
        s->ts = now / 1000;
        s->sm = (unsigned)(busy * 100 / dt);
        if (s->sm > 100) s->sm = 100;
        s->mem = s->enc = s->dec = 0;
    }
    window_ns = now;
}

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
    for (unsigned i = 0; i < have; i++) {
        memset(&out[i], 0, sizeof out[i]);
        out[i].pid = g->pids[i];
        out[i].mem = g->proc_mem[i];
    }
    *n = have;
    fake_unlock(g);
    return 0;
}
nvmlReturn_t nvmlDeviceGetProcessUtilization(void *dev, struct sample *out, unsigned *n, unsigned long long since) {
    (void)dev;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    sample(g);
    unsigned fresh = 0;
    for (unsigned i = 0; i < nsamples; i++)
        if (samples[i].ts > since) fresh++;
    if (!fresh) { fake_unlock(g); return 6; } /* NOT_FOUND */
    if (!out || *n < fresh) { *n = fresh; fake_unlock(g); return 7; }
    unsigned k = 0;
    for (unsigned i = 0; i < nsamples; i++)
        if (samples[i].ts > since) out[k++] = samples[i];
    fake_unlock(g);
    *n = k;
    return 0;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(void *dev, struct util *u) {
    (void)dev;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    uint64_t now = fake_now_ns();
    uint64_t dt = card_ns ? now - card_ns : 0;
    u->gpu = dt ? (unsigned)((g->busy_total_ns - card_total) * 100 / dt) : 0;
    if (u->gpu > 100) u->gpu = 100;
    card_total = g->busy_total_ns;
    card_ns = now;
    fake_unlock(g);
    u->memory = 0;
    return 0;
}
