// What a container's CUDA sees, as `key=value` lines, for tests/gpu/run.sh.
//
//   probe [--alloc-gib N] [--bench-ms MS] [--fill] [--hold-ms MS] [--pool-gib N] [--vmm-gib N]
//
// devices, mps_threads (the MPS limit the container was given, if any), name, sms
// (multiProcessorCount: limited under MPS), mem_total_mib / mem_free_mib
// (cudaMemGetInfo), then optionally one cudaMalloc of N GiB (`alloc=ok` or the error) and a
// compute-bound kernel run for MS milliseconds (`kernels_per_s`, a fixed grid, so throughput
// is comparable between a whole card and a share). Then, each if asked:
//
// --fill      cudaMalloc 256 MiB blocks until one is refused (`filled_mib`), held for --hold-ms
//             so the node's metrics can see what the process really holds, then freed;
// --pool-gib  the device's default pool keeps what is freed (release threshold at the most),
//             cudaMallocAsync + cudaFreeAsync of N GiB (`pool_reserved_mib`: what the pool still
//             holds), then a cudaMalloc of N GiB beside it (`pool_then_alloc`);
// --vmm-gib   cuMemCreate + cuMemMap of N GiB, cuMemRelease while mapped (ggml-cuda does so;
//             the memory stays until unmapped), then a cudaMalloc of N GiB beside it
//             (`vmm_then_alloc`).
//
// `mem_free_end_mib` closes the report. Exit status 0 unless an argument is bad: what CUDA
// refuses is reported, not fatal.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <unistd.h>

__global__ void spin(float *out, int iters) {
    float x = threadIdx.x * 0.001f + blockIdx.x;
    for (int i = 0; i < iters; ++i) {
        x = x * 1.0000001f + 0.0000001f;
    }
    if (x == 1234.5678f) {
        out[0] = x;  // never true; keeps the loop from being optimised away
    }
}

static size_t gib(double n) { return (size_t)(n * 1073741824.0); }

// A cudaMalloc of `bytes` beside what the caller holds: "ok" or the error (cleared).
static const char *alloc_beside(size_t bytes) {
    void *p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (p) {
        cudaFree(p);
    }
    cudaGetLastError();
    return e == cudaSuccess ? "ok" : cudaGetErrorString(e);
}

static void fill_and_hold(int hold_ms) {
    const size_t block = 256u << 20;
    void *blocks[4096];
    int n = 0;
    while (n < 4096 && cudaMalloc(&blocks[n], block) == cudaSuccess) {
        ++n;
    }
    cudaGetLastError();
    printf("filled_mib=%d\n", n * 256);
    fflush(stdout);
    usleep((useconds_t)hold_ms * 1000);
    while (n > 0) {
        cudaFree(blocks[--n]);
    }
}

static void pool_keeps(double n_gib) {
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, 0) != cudaSuccess) {
        printf("pool=%s\n", cudaGetErrorString(cudaGetLastError()));
        return;
    }
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    void *p = nullptr;
    cudaError_t e = cudaMallocAsync(&p, gib(n_gib), 0);
    if (e == cudaSuccess) {
        cudaFreeAsync(p, 0);
    }
    cudaStreamSynchronize(0);
    printf("pool_alloc=%s\n", e == cudaSuccess ? "ok" : cudaGetErrorString(e));
    cudaGetLastError();
    uint64_t reserved = 0;
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved);
    printf("pool_reserved_mib=%llu\n", (unsigned long long)(reserved >> 20));
    printf("pool_then_alloc=%s\n", alloc_beside(gib(n_gib)));
    cudaMemPoolTrimTo(pool, 0);
    fflush(stdout);
}

// A driver entry point as frameworks reach one: through the runtime's cuGetProcAddress (so the
// probe needs no libcuda at link time, and runs in a container given none).
static void *driver_fn(const char *name) {
    void *fn = nullptr;
#if CUDART_VERSION >= 12050
    cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, nullptr);
#else
    cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault);
#endif
    return fn;
}

static void vmm_released_while_mapped(double n_gib) {
    auto ctx_get_device = (CUresult(*)(CUdevice *))driver_fn("cuCtxGetDevice");
    auto granularity_of = (CUresult(*)(size_t *, const CUmemAllocationProp *,
                                       CUmemAllocationGranularity_flags))driver_fn("cuMemGetAllocationGranularity");
    auto create = (CUresult(*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                               unsigned long long))driver_fn("cuMemCreate");
    auto reserve = (CUresult(*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))driver_fn(
        "cuMemAddressReserve");
    auto map = (CUresult(*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))driver_fn(
        "cuMemMap");
    auto release = (CUresult(*)(CUmemGenericAllocationHandle))driver_fn("cuMemRelease");
    auto unmap = (CUresult(*)(CUdeviceptr, size_t))driver_fn("cuMemUnmap");
    auto address_free = (CUresult(*)(CUdeviceptr, size_t))driver_fn("cuMemAddressFree");
    if (!ctx_get_device || !granularity_of || !create || !reserve || !map || !release || !unmap || !address_free) {
        printf("vmm=entry points missing\n");
        return;
    }
    CUdevice dev;
    if (ctx_get_device(&dev) != CUDA_SUCCESS) {
        printf("vmm=no context\n");
        return;
    }
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t granularity = 0;
    granularity_of(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    size_t bytes = gib(n_gib);
    if (granularity) {
        bytes = (bytes + granularity - 1) / granularity * granularity;
    }
    CUmemGenericAllocationHandle h;
    CUresult r = create(&h, bytes, &prop, 0);
    if (r != CUDA_SUCCESS) {
        printf("vmm_create=error %d\n", (int)r);
        return;
    }
    CUdeviceptr va = 0;
    reserve(&va, bytes, 0, 0, 0);
    r = map(va, bytes, 0, h, 0);
    release(h);  // still mapped: the driver keeps the memory until the unmap
    printf("vmm_create=ok\nvmm_map=%s\n", r == CUDA_SUCCESS ? "ok" : "failed");
    printf("vmm_then_alloc=%s\n", alloc_beside(gib(n_gib)));
    if (r == CUDA_SUCCESS) {
        unmap(va, bytes);
    }
    address_free(va, bytes);
    fflush(stdout);
}

int main(int argc, char **argv) {
    double alloc_gib = 0, pool_gib = 0, vmm_gib = 0;
    int bench_ms = 0, hold_ms = 0;
    bool fill = false;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--alloc-gib") && i + 1 < argc) {
            alloc_gib = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--bench-ms") && i + 1 < argc) {
            bench_ms = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--hold-ms") && i + 1 < argc) {
            hold_ms = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--pool-gib") && i + 1 < argc) {
            pool_gib = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--vmm-gib") && i + 1 < argc) {
            vmm_gib = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--fill")) {
            fill = true;
        } else {
            fprintf(stderr,
                    "usage: probe [--alloc-gib N] [--bench-ms MS] [--fill] [--hold-ms MS] [--pool-gib N] "
                    "[--vmm-gib N]\n");
            return 2;
        }
    }
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        printf("devices=0\nerror=%s\n", cudaGetErrorString(e));
        return 0;
    }
    printf("devices=%d\n", n);
    const char *mps = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    if (mps) {
        printf("mps_threads=%s\n", mps);
    }
    if (n == 0) {
        return 0;
    }
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    printf("name=%s\nsms=%d\n", p.name, p.multiProcessorCount);
    size_t free_b = 0, total_b = 0;
    e = cudaMemGetInfo(&free_b, &total_b);
    if (e != cudaSuccess) {
        printf("error=%s\n", cudaGetErrorString(e));
        return 0;
    }
    printf("mem_total_mib=%zu\nmem_free_mib=%zu\n", total_b >> 20, free_b >> 20);
    fflush(stdout);
    if (alloc_gib > 0) {
        void *ptr = nullptr;
        size_t bytes = (size_t)(alloc_gib * 1073741824.0);
        e = cudaMalloc(&ptr, bytes);
        printf("alloc_gib=%g\nalloc=%s\n", alloc_gib, e == cudaSuccess ? "ok" : cudaGetErrorString(e));
        if (ptr) {
            cudaFree(ptr);
        }
        cudaGetLastError();  // clear a failed allocation's error
        fflush(stdout);
    }
    if (bench_ms > 0) {
        float *out = nullptr;
        if (cudaMalloc(&out, sizeof(float)) != cudaSuccess) {
            printf("bench=no memory\n");
            return 0;
        }
        const int blocks = 1024, threads = 256, iters = 1 << 15;
        spin<<<blocks, threads>>>(out, iters);  // warm-up
        cudaDeviceSynchronize();
        auto start = std::chrono::steady_clock::now();
        long launches = 0;
        double elapsed = 0;
        while (elapsed * 1000.0 < bench_ms) {
            spin<<<blocks, threads>>>(out, iters);
            e = cudaDeviceSynchronize();
            if (e != cudaSuccess) {
                printf("bench=%s\n", cudaGetErrorString(e));
                return 0;
            }
            ++launches;
            elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
        printf("kernels=%ld\nkernels_per_s=%.2f\n", launches, launches / elapsed);
        cudaFree(out);
    }
    if (fill) {
        fill_and_hold(hold_ms);
    }
    if (pool_gib > 0) {
        pool_keeps(pool_gib);
    }
    if (vmm_gib > 0) {
        vmm_released_while_mapped(vmm_gib);
    }
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
        printf("mem_free_end_mib=%zu\n", free_b >> 20);
    }
    return 0;
}
