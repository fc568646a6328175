// Loads libcuda the way every CUDA program does (by soname, through the loader's search path)
// and reports what the real driver library answers without a GPU: cuDriverGetVersion works,
// cuInit returns 100 (CUDA_ERROR_NO_DEVICE). Prints where libcuda was loaded from.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) { printf("dlopen failed: %s\n", dlerror()); return 2; }
  int (*get_version)(int *) = (int (*)(int *))dlsym(h, "cuDriverGetVersion");
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
  if (!get_version || !init) { printf("dlsym failed: %s\n", dlerror()); return 3; }
  int v = 0;
  int rc = get_version(&v);
  int i = init(0);
  Dl_info info;
  dladdr((void *)get_version, &info);
  printf("cuDriverGetVersion=%d rc=%d cuInit=%d libcuda=%s\n", v, rc, i, info.dli_fname);
  return 0;
}
