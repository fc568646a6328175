/* A program linked against LLVM's OpenMP runtime (libomp.so.5). At startup libomp looks for an
 * OMPT tool with dlsym(RTLD_NEXT, "ompt_start_tool") from its own weak definition: under a
 * preloaded library that forwards RTLD_NEXT wrongly, it finds itself and never returns. */
#include <stdio.h>
int omp_get_max_threads(void);
int main(void) {
    printf("omp_max_threads=%d\n", omp_get_max_threads());
    return 0;
}
