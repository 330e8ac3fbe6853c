// cuBLASLt's algorithms for y = x w^T, one at a time (``cublaslt.py`` builds, loads and calls this).
//
// torch's F.linear takes the one algorithm cuBLAS's heuristic ranks first. At decode batches (M = 17-1,024 rows)
// that choice reads the 8B model's smaller weights at 66-78 % of HBM bandwidth on the H200 (docs/perf.md, the
// twenty-seventh session), so the start-up tuning times the heuristic's next candidates too (split-K and tile
// variants) and keeps one only where it is correct and faster. Host code only: the kernels are cuBLASLt's.
//
// The library is the one torch has loaded (dlopen of its soname with RTLD_NOLOAD first), its functions found by
// dlsym, so nothing links against a cuBLAS of another version. Row-major x (M, K), w (N, K), y (M, N) are
// column-major x^T (K, M), w^T (K, N), y^T (N, M): y^T = op(w^T) x^T with op = transpose, the layout cuBLAS itself
// runs F.linear in. Descriptors are cached per (M, N, K, leading dimensions, dtype): a call inside a CUDA graph's
// capture or an eager step costs one map lookup and the launch. Past ``kMaxPlans`` shapes (eager prompt chunks come
// in every M) a call makes its descriptors and destroys them after the launch (a few microseconds on a call of
// milliseconds), so the cache stays bounded.
#include <cublasLt.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace {

#define BANYAN_STR2(x) #x
#define BANYAN_STR(x) BANYAN_STR2(x)

void* library() {
  static void* handle = [] {
    const char* name = "libcublasLt.so." BANYAN_STR(CUBLAS_VER_MAJOR);
    void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // (torch's, already resident)
    return h ? h : dlopen(name, RTLD_NOW | RTLD_LOCAL);
  }();
  return handle;
}

template <typename F>
F* symbol(const char* name) {
  void* lib = library();
  return lib ? reinterpret_cast<F*>(dlsym(lib, name)) : nullptr;
}

#define LT(fn) static auto* p_##fn = symbol<decltype(fn)>(#fn)

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
};

using Key = std::tuple<int, int, int, int64_t, int64_t, int64_t, int>;
constexpr size_t kMaxPlans = 4096;
std::mutex mu;
std::map<Key, Plan> plans;
cublasLtHandle_t handle = nullptr;

cudaDataType_t data_type(int dtype) { return dtype == 0 ? CUDA_R_16BF : CUDA_R_16F; }

// A plan's descriptors destroyed (one made past the cache's bound, or one whose making failed half way).
void release(Plan& p) {
  LT(cublasLtMatmulDescDestroy);
  LT(cublasLtMatrixLayoutDestroy);
  if (!p_cublasLtMatmulDescDestroy || !p_cublasLtMatrixLayoutDestroy) return;
  if (p.desc) p_cublasLtMatmulDescDestroy(p.desc);
  for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c})
    if (l) p_cublasLtMatrixLayoutDestroy(l);
  p = Plan{};
}

// The handle and the descriptors of one shape: the cached ones, else made and cached, else (the cache full) made
// into ``*scratch``, which the caller releases. Status of the first failure, else 0.
int plan_for(int m, int n, int k, int64_t ldx, int64_t ldw, int64_t ldy, int dtype, Plan* scratch, Plan** out) {
  LT(cublasLtCreate);
  LT(cublasLtMatmulDescCreate);
  LT(cublasLtMatmulDescSetAttribute);
  LT(cublasLtMatrixLayoutCreate);
  if (!p_cublasLtCreate || !p_cublasLtMatmulDescCreate || !p_cublasLtMatmulDescSetAttribute ||
      !p_cublasLtMatrixLayoutCreate)
    return -1;
  std::lock_guard<std::mutex> lock(mu);
  if (!handle) {
    if (int s = p_cublasLtCreate(&handle)) return s;
  }
  Key key{m, n, k, ldx, ldw, ldy, dtype};
  auto it = plans.find(key);
  if (it != plans.end()) {
    *out = &it->second;
    return 0;
  }
  Plan p;
  cudaDataType_t t = data_type(dtype);
  cublasOperation_t trans = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  int s = p_cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (!s) s = p_cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans));
  if (!s) s = p_cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep));
  if (!s) s = p_cublasLtMatrixLayoutCreate(&p.a, t, k, n, ldw);  // w^T stored (K, N): op = T → (N, K)
  if (!s) s = p_cublasLtMatrixLayoutCreate(&p.b, t, k, m, ldx);  // x^T (K, M)
  if (!s) s = p_cublasLtMatrixLayoutCreate(&p.c, t, n, m, ldy);  // y^T (N, M)
  if (s) {
    release(p);
    return s;
  }
  if (plans.size() >= kMaxPlans) {
    *scratch = p;
    *out = scratch;
  } else {
    *out = &plans.emplace(key, p).first->second;
  }
  return 0;
}

// A plan for one call: the cached one, or its own (released when it goes out of scope).
struct CallPlan {
  Plan scratch;
  Plan* plan = nullptr;
  int status;
  CallPlan(int m, int n, int k, int64_t ldx, int64_t ldw, int64_t ldy, int dtype)
      : status(plan_for(m, n, k, ldx, ldw, ldy, dtype, &scratch, &plan)) {}
  ~CallPlan() {
    if (plan == &scratch) release(scratch);
  }
};

}  // namespace

extern "C" {

// Up to ``max`` algorithms cuBLASLt's heuristic proposes for this shape with at most ``workspace`` bytes of
// workspace, best-ranked first: each one's 64-byte descriptor into ``algos`` (max × 64 bytes) and the workspace it
// needs into ``sizes``. Returns how many, or a negative cuBLAS status (-1: the library or a function is missing).
int banyan_lt_algos(int m, int n, int k, int dtype, int64_t workspace, int max, void* algos, int64_t* sizes) {
  LT(cublasLtMatmulPreferenceCreate);
  LT(cublasLtMatmulPreferenceSetAttribute);
  LT(cublasLtMatmulPreferenceDestroy);
  LT(cublasLtMatmulAlgoGetHeuristic);
  if (!p_cublasLtMatmulPreferenceCreate || !p_cublasLtMatmulPreferenceSetAttribute ||
      !p_cublasLtMatmulPreferenceDestroy || !p_cublasLtMatmulAlgoGetHeuristic || max <= 0 || max > 64)
    return -1;
  CallPlan call(m, n, k, k, k, n, dtype);
  if (call.status) return -call.status;
  Plan* p = call.plan;
  cublasLtMatmulPreference_t pref = nullptr;
  if (int s = p_cublasLtMatmulPreferenceCreate(&pref)) return -s;
  uint64_t bytes = static_cast<uint64_t>(workspace);
  int status = p_cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes,
                                                      sizeof(bytes));
  cublasLtMatmulHeuristicResult_t results[64];
  int found = 0;
  if (!status)
    status = p_cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->a, p->b, p->c, p->c, pref, max, results, &found);
  p_cublasLtMatmulPreferenceDestroy(pref);
  if (status) return -status;
  int kept = 0;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    std::memcpy(static_cast<char*>(algos) + 64 * kept, &results[i].algo, 64);
    sizes[kept++] = static_cast<int64_t>(results[i].workspaceSize);
  }
  return kept;
}

// Whether ``algo`` runs this shape (cuBLASLt's check: 0, and the workspace it needs in ``size``), else its status.
int banyan_lt_check(int m, int n, int k, int64_t ldx, int64_t ldw, int64_t ldy, int dtype, const void* algo,
                    int64_t* size) {
  LT(cublasLtMatmulAlgoCheck);
  if (!p_cublasLtMatmulAlgoCheck) return -1;
  CallPlan call(m, n, k, ldx, ldw, ldy, dtype);
  if (call.status) return call.status;
  Plan* p = call.plan;
  cublasLtMatmulHeuristicResult_t result;
  std::memset(&result, 0, sizeof(result));
  int s = p_cublasLtMatmulAlgoCheck(handle, p->desc, p->a, p->b, p->c, p->c,
                                    static_cast<const cublasLtMatmulAlgo_t*>(algo), &result);
  *size = static_cast<int64_t>(result.workspaceSize);
  return s;
}

// y (M, N) = x (M, K) w (N, K)^T with ``algo`` on ``stream`` (rows ``ldx``, ``ldw``, ``ldy`` elements apart):
// 0, else the cuBLAS status (nothing launched).
int banyan_lt_matmul(const void* x, const void* w, void* y, int m, int n, int k, int64_t ldx, int64_t ldw,
                     int64_t ldy, int dtype, const void* algo, void* workspace, int64_t workspace_bytes,
                     void* stream) {
  LT(cublasLtMatmul);
  if (!p_cublasLtMatmul) return -1;
  CallPlan call(m, n, k, ldx, ldw, ldy, dtype);
  if (call.status) return call.status;
  Plan* p = call.plan;
  const float one = 1.0f, zero = 0.0f;
  return p_cublasLtMatmul(handle, p->desc, &one, w, p->a, x, p->b, &zero, y, p->c, y, p->c,
                          static_cast<const cublasLtMatmulAlgo_t*>(algo), workspace,
                          static_cast<size_t>(workspace_bytes), static_cast<cudaStream_t>(stream));
}

}  // extern "C"
