/* A CUDA driver API client for tessera-cuda-hook's tests, reaching the driver the two ways
 * real programs do: built with -DLINKED it calls the functions it was linked against (-lcuda);
 * otherwise it dlopens libcuda.so.1, finds cuGetProcAddress_v2 with dlsym and looks every
 * other function up through it, as the CUDA runtime does. Prints key=value lines.
 *
 *   info                       free, total (cuMemGetInfo) and cuDeviceTotalMem
 *   fill MIB [HOLD_MS]         allocate MIB chunks until refused; hold; free all
 *   threads N MIB              N threads each allocate MIB chunks until refused
 *   kinds                      one allocation of each kind, then all freed
 *   vmm MIB                    cuMemCreate, cuMemMap, cuMemRelease, then cuMemUnmap
 *   pool MIB keep|release      cuMemAllocAsync + cuMemFreeAsync of MIB from the default pool
 *                              (release threshold at the most, or 0), a stream sync, then
 *                              cuMemAlloc of MIB beside it; cuMemPoolTrimTo(0), and again
 *   ctx                        cuCtxCreate looked up at 12080 (the _v3 entry) and called
 *   legacy MIB                 the pre-3.2 cuMemAlloc (32-bit), which the hook must not wrap
 *   launch MS BLOCKS           launch kernels of BLOCKS blocks for MS ms; busy share of the
 *                              fake GPU over the second half, and launches a second
 *   capture MS                 one launch, then a stream captured for MS ms (nothing launched):
 *                              what cuStreamEndCapture answered
 *   work                       (no CUDA) the work all the fake card's processes had it do so
 *                              far, and when
 *   hostpid SOCKET [HOLD_MS]   what the node agent answers on a host-pid socket, and getpid();
 *                              then stays HOLD_MS */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include "fake_gpu.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *H;
#define MIB (1ull << 20)

struct api {
    CUresult (*init)(unsigned);
    CUresult (*retain)(H *, int);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free_)(CUdeviceptr);
    CUresult (*pitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
    CUresult (*managed)(CUdeviceptr *, size_t, unsigned);
    CUresult (*async_)(CUdeviceptr *, size_t, H);
    CUresult (*pool)(CUdeviceptr *, size_t, H, H);
    CUresult (*free_async)(CUdeviceptr, H);
    CUresult (*create)(unsigned long long *, size_t, const void *, unsigned long long);
    CUresult (*release)(unsigned long long);
    CUresult (*map)(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*array)(H *, const void *);
    CUresult (*array3d)(H *, const void *);
    CUresult (*array_destroy)(H);
    CUresult (*meminfo)(size_t *, size_t *);
    CUresult (*devtotal)(size_t *, int);
    CUresult (*launch)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, H, void **, void **);
    CUresult (*begin_capture)(H, int);
    CUresult (*end_capture)(H, H *);
    CUresult (*default_pool)(H *, int);
    CUresult (*pool_set)(H, int, void *);
    CUresult (*pool_get)(H, int, void *);
    CUresult (*trim)(H, size_t);
    CUresult (*sync)(H);
} api;

typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long, int *);
static gpa_t gpa;

#ifdef LINKED
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(H *, int);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, H);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, H, H);
CUresult cuMemFreeAsync(CUdeviceptr, H);
CUresult cuMemCreate(unsigned long long *, size_t, const void *, unsigned long long);
CUresult cuMemRelease(unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuArrayCreate_v2(H *, const void *);
CUresult cuArray3DCreate_v2(H *, const void *);
CUresult cuArrayDestroy(H);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, int);
CUresult cuLaunchKernel(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, H, void **, void **);
CUresult cuStreamBeginCapture_v2(H, int);
CUresult cuStreamEndCapture(H, H *);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
CUresult cuDeviceGetDefaultMemPool(H *, int);
CUresult cuMemPoolSetAttribute(H, int, void *);
CUresult cuMemPoolGetAttribute(H, int, void *);
CUresult cuMemPoolTrimTo(H, size_t);
CUresult cuStreamSynchronize(H);
#define R(field, name, linked) api.field = (void *)(linked)
#else
static void *get(const char *name) {
    void *p = NULL;
    int st;
    if (gpa(name, &p, 12080, 0, &st)) return NULL;
    return p;
}
#define R(field, name, linked) api.field = get(name)
#endif

static void load(void) {
#ifdef LINKED
    gpa = cuGetProcAddress_v2;
#else
    /* $CLIENT_DLMOPEN: the driver loaded into a link namespace of its own, where no preloaded
     * library is (how a program goes around an LD_PRELOAD hook). */
    void *h = getenv("CLIENT_DLMOPEN") ? dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW) : dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("error=%s\n", dlerror()); exit(3); }
    gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
    if (!gpa) { printf("error=no cuGetProcAddress_v2\n"); exit(3); }
    /* The runtime then looks cuGetProcAddress up through itself. */
    void *self = NULL;
    if (gpa("cuGetProcAddress", &self, 12080, 0, NULL) == 0 && self) gpa = (gpa_t)self;
#endif
    R(init, "cuInit", cuInit);
    R(retain, "cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain);
    R(alloc, "cuMemAlloc", cuMemAlloc_v2);
    R(free_, "cuMemFree", cuMemFree_v2);
    R(pitch, "cuMemAllocPitch", cuMemAllocPitch_v2);
    R(managed, "cuMemAllocManaged", cuMemAllocManaged);
    R(async_, "cuMemAllocAsync", cuMemAllocAsync);
    R(pool, "cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync);
    R(free_async, "cuMemFreeAsync", cuMemFreeAsync);
    R(create, "cuMemCreate", cuMemCreate);
    R(release, "cuMemRelease", cuMemRelease);
    R(map, "cuMemMap", cuMemMap);
    R(unmap, "cuMemUnmap", cuMemUnmap);
    R(array, "cuArrayCreate", cuArrayCreate_v2);
    R(array3d, "cuArray3DCreate", cuArray3DCreate_v2);
    R(array_destroy, "cuArrayDestroy", cuArrayDestroy);
    R(meminfo, "cuMemGetInfo", cuMemGetInfo_v2);
    R(devtotal, "cuDeviceTotalMem", cuDeviceTotalMem_v2);
    R(launch, "cuLaunchKernel", cuLaunchKernel);
    R(begin_capture, "cuStreamBeginCapture", cuStreamBeginCapture_v2);
    R(end_capture, "cuStreamEndCapture", cuStreamEndCapture);
    R(default_pool, "cuDeviceGetDefaultMemPool", cuDeviceGetDefaultMemPool);
    R(pool_set, "cuMemPoolSetAttribute", cuMemPoolSetAttribute);
    R(pool_get, "cuMemPoolGetAttribute", cuMemPoolGetAttribute);
    R(trim, "cuMemPoolTrimTo", cuMemPoolTrimTo);
    R(sync, "cuStreamSynchronize", cuStreamSynchronize);
    H ctx;
    api.init(0);
    api.retain(&ctx, 0);
}

static unsigned long long used(void) {
    size_t f, t;
    api.meminfo(&f, &t);
    return (unsigned long long)(t - f);
}

static int fill(unsigned long long chunk, CUdeviceptr *ptrs, int max) {
    int n = 0;
    while (n < max && api.alloc(&ptrs[n], chunk) == 0) n++;
    return n;
}

struct targs { unsigned long long chunk; int n; };
static void *thread_fill(void *a) {
    struct targs *t = a;
    static __thread CUdeviceptr ptrs[4096];
    t->n = fill(t->chunk, ptrs, 4096);
    return NULL;
}

/* The work process slot `p` had the fake card do by `now` (whole-card ns; the lock held): what
 * it was given, less what is still queued (under $FAKE_MPS a process queues far ahead, at the
 * percentage in this process's environment; otherwise launches are at most 2 ms ahead, which
 * is not subtracted). */
static uint64_t done_of(struct fake_gpu *g, int p, uint64_t now) {
    if (p < 0) return 0;
    uint64_t busy = g->busy_ns[p], until = g->proc_until[p];
    if (getenv("FAKE_MPS") && until > now) {
        const char *pc = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
        uint64_t pct = pc ? (uint64_t)atoll(pc) : 100;
        if (pct < 1 || pct > 100) pct = 100;
        uint64_t queued = (until - now) * pct / 100;
        busy = busy > queued ? busy - queued : 0;
    }
    return busy;
}

static uint64_t done_ns(uint64_t now) {
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    uint64_t d = done_of(g, fake_proc(g, (uint32_t)getpid()), now);
    fake_unlock(g);
    return d;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    const char *cmd = argc > 1 ? argv[1] : "info";
    if (!strcmp(cmd, "work")) {
        /* Reads the card only (no CUDA): all its processes' work done so far, and when. */
        struct fake_gpu *g = fake_gpu();
        fake_lock(g);
        uint64_t now = fake_now_ns(), w = 0;
        for (uint32_t i = 0; i < g->nprocs; i++) w += done_of(g, (int)i, now);
        fake_unlock(g);
        printf("work_ns=%llu\nat_ns=%llu\n", (unsigned long long)w, (unsigned long long)now);
        return 0;
    }
    load();
    if (!strcmp(cmd, "info")) {
        size_t f, t, d;
        api.meminfo(&f, &t);
        api.devtotal(&d, 0);
        printf("free=%zu\ntotal=%zu\ndevtotal=%zu\n", f, t, d);
    } else if (!strcmp(cmd, "fill")) {
        unsigned long long chunk = strtoull(argv[2], NULL, 10) * MIB;
        static CUdeviceptr ptrs[65536];
        int n = fill(chunk, ptrs, 65536);
        printf("allocated_mib=%llu\n", n * chunk / MIB);
        if (argc > 3) usleep((useconds_t)atoi(argv[3]) * 1000);
        for (int i = 0; i < n; i++) api.free_(ptrs[i]);
        size_t f, t;
        api.meminfo(&f, &t);
        printf("free_after_mib=%zu\n", f / MIB);
    } else if (!strcmp(cmd, "threads")) {
        int n = atoi(argv[2]);
        pthread_t th[64];
        struct targs a[64];
        for (int i = 0; i < n; i++) { a[i].chunk = strtoull(argv[3], NULL, 10) * MIB; pthread_create(&th[i], NULL, thread_fill, &a[i]); }
        unsigned long long total = 0;
        for (int i = 0; i < n; i++) { pthread_join(th[i], NULL); total += a[i].n * a[i].chunk; }
        printf("allocated_mib=%llu\n", total / MIB);
    } else if (!strcmp(cmd, "kinds")) {
        CUdeviceptr p[6]; size_t pitch; unsigned long long vmm; H arr, arr3, pool;
        api.default_pool(&pool, 0);
        struct { size_t w, h; unsigned fmt, ch; } d2 = {256, 256, 0x20, 4};      /* 1 MiB */
        struct { size_t w, h, d; unsigned fmt, ch, fl; } d3 = {64, 64, 64, 0x01, 4, 0}; /* 1 MiB */
        unsigned long long base = used();
        int r;
#define STEP(name, call) r = (call); printf(name "=%d used=%llu\n", r, used() - base);
        STEP("alloc", api.alloc(&p[0], MIB))
        STEP("pitch", api.pitch(&p[1], &pitch, 1000, 1024, 4))
        STEP("managed", api.managed(&p[2], MIB, 1))
        STEP("async", api.async_(&p[3], MIB, NULL))
        STEP("pool", api.pool(&p[4], MIB, pool, NULL))
        STEP("vmm", api.create(&vmm, MIB, NULL, 0))
        STEP("array", api.array(&arr, &d2))
        STEP("array3d", api.array3d(&arr3, &d3))
        for (int i = 0; i < 3; i++) api.free_(p[i]);
        api.free_async(p[3], NULL);
        api.free_async(p[4], NULL);
        api.release(vmm);
        api.array_destroy(arr);
        api.array_destroy(arr3);
        api.sync(NULL); /* the pool gives back what it holds above its threshold (0) */
        printf("after_free=%llu\n", used() - base);
    } else if (!strcmp(cmd, "vmm")) {
        /* ggml-cuda's pattern: create, map, release at once; the memory stays until unmapped. */
        unsigned long long n = strtoull(argv[2], NULL, 10) * MIB, h;
        CUdeviceptr va = 0x7f0000000000ull;
        unsigned long long base = used();
        printf("create=%d\n", api.create(&h, n, NULL, 0));
        printf("map=%d\n", api.map(va, n, 0, h, 0));
        int r = api.release(h);
        printf("release=%d released_used_mib=%llu\n", r, (used() - base) / MIB);
        r = api.unmap(va, n);
        printf("unmap=%d unmapped_used_mib=%llu\n", r, (used() - base) / MIB);
    } else if (!strcmp(cmd, "pool")) {
        unsigned long long n = strtoull(argv[2], NULL, 10) * MIB;
        unsigned long long keep = !strcmp(argv[3], "keep") ? ~0ull : 0, held = 0;
        H pool;
        CUdeviceptr a, b;
        api.default_pool(&pool, 0);
        api.pool_set(pool, 4, &keep); /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
        printf("async=%d\n", api.async_(&a, n, NULL));
        api.free_async(a, NULL);
        api.sync(NULL);
        api.pool_get(pool, 5, &held); /* CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT */
        int r = api.alloc(&b, n);
        printf("held_mib=%llu beside=%d\n", held / MIB, r);
        if (r == 0) api.free_(b);
        api.trim(pool, 0);
        r = api.alloc(&b, n);
        if (r == 0) api.free_(b);
        printf("trimmed_beside=%d used_after_mib=%llu\n", r, used() / MIB);
    } else if (!strcmp(cmd, "ctx")) {
        /* cuCtxCreate as the CUDA 12 runtime looks it up; which library answers it. */
        CUresult (*create)(H *, void *, int, unsigned, int) = NULL;
        int st;
        gpa("cuCtxCreate", (void **)&create, 12080, 0, &st);
        H c;
        Dl_info info;
        int r = create ? create(&c, NULL, 0, 0, 0) : -1;
        printf("ctx=%d ctx_from=%s\n", r, create && dladdr((void *)create, &info) && info.dli_fname ? strrchr(info.dli_fname, '/') + 1 : "none");
    } else if (!strcmp(cmd, "hostpid")) {
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        strncpy(a.sun_path, argv[2], sizeof a.sun_path - 1);
        char buf[32] = "";
        if (s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0) {
            ssize_t n = read(s, buf, sizeof buf - 1);
            buf[n > 0 ? n : 0] = 0;
        }
        buf[strcspn(buf, "\n")] = 0;
        printf("host_pid=%s\npid=%d\n", buf[0] ? buf : "none", (int)getpid());
        if (argc > 3) usleep((useconds_t)atoi(argv[3]) * 1000);
    } else if (!strcmp(cmd, "legacy")) {
        CUresult (*legacy)(unsigned *, unsigned) = NULL;
        int st;
        gpa("cuMemAlloc", (void **)&legacy, 3000, 0, &st);
        unsigned p;
        printf("legacy=%d\n", legacy ? legacy(&p, (unsigned)(strtoull(argv[2], NULL, 10) * MIB)) : -1);
    } else if (!strcmp(cmd, "capture")) {
        H stream = (H)0x10, graph = NULL;
        api.launch(NULL, 1, 1, 1, 128, 1, 1, 0, NULL, NULL, NULL);
        int begun = api.begin_capture(stream, 0);
        usleep((useconds_t)atoi(argv[2]) * 1000);
        printf("begin_capture=%d\ncapture=%d\n", begun, api.end_capture(stream, &graph));
    } else if (!strcmp(cmd, "launch")) {
        long ms = atol(argv[2]);
        unsigned blocks = (unsigned)atoi(argv[3]);
        uint64_t start = fake_now_ns(), mid_busy = 0, mid = 0, n = 0;
        for (;;) {
            uint64_t now = fake_now_ns();
            if (now - start > (uint64_t)ms * 1000000ull) break;
            if (!mid && now - start > (uint64_t)ms * 500000ull) {
                mid_busy = done_ns(now);
                mid = now;
            }
            api.launch(NULL, blocks, 1, 1, 128, 1, 1, 0, NULL, NULL, NULL);
            n++;
        }
        uint64_t end = fake_now_ns();
        printf("busy_percent=%.1f\nlaunches_per_s=%.0f\n", 100.0 * (double)(done_ns(end) - mid_busy) / (double)(end - mid),
               (double)n * 1e9 / (double)(end - start));
    }
    return 0;
}
