// What a container's CUDA sees, as `key=value` lines, for tests/gpu/run.sh.
//
//   probe [--alloc-gib N] [--bench-ms MS]
//
// devices, mps_threads (the MPS limit the container was given, if any), name, sms
// (multiProcessorCount: limited under MPS), mem_total_mib / mem_free_mib
// (cudaMemGetInfo), then optionally one cudaMalloc of N GiB (`alloc=ok` or the error) and a
// compute-bound kernel run for MS milliseconds (`kernels_per_s`, a fixed grid, so throughput
// is comparable between a whole card and a share). Exit status 0 unless an argument is bad:
// what CUDA refuses is reported, not fatal.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

__global__ void spin(float *out, int iters) {
    float x = threadIdx.x * 0.001f + blockIdx.x;
    for (int i = 0; i < iters; ++i) {
        x = x * 1.0000001f + 0.0000001f;
    }
    if (x == 1234.5678f) {
        out[0] = x;  // never true; keeps the loop from being optimised away
    }
}

int main(int argc, char **argv) {
    double alloc_gib = 0;
    int bench_ms = 0;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--alloc-gib") && i + 1 < argc) {
            alloc_gib = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--bench-ms") && i + 1 < argc) {
            bench_ms = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: probe [--alloc-gib N] [--bench-ms MS]\n");
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
    return 0;
}
