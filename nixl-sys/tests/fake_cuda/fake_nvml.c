/* A fake NVML (`libnvidia-ml.so.1`) for loading the real libuct_cuda in the
 * GPU-mapping binding test: the one symbol it imports. */
#define EXPORT __attribute__((visibility("default")))
EXPORT const char *
nvmlErrorString(int result) {
    (void)result;
    return "no NVML here (fake)";
}
