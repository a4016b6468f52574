// Host fast path of the cute backend's wrappers: the per-call work of csa_compressor_forward_wrapper /
// csa_compressor_backward_wrapper (tensor checks, output allocation, argument packing, the call of the
// DSL-compiled host function) in C++ instead of Python; forward_into / backward_into do the same for the classes'
// execute() with caller-provided buffers (no allocation). Built on first use by host_ext.py
// (torch.utils.cpp_extension), optional: anything unusual returns None and the Python path takes over (and
// raises the proper error), so the checks here only ever accept what support.recheck_* accepts.
//
// A Launch record owns its own argument slots, packed argument array and CUDA-result cell (the Python
// _Launcher has its own): the DSL host function reads its arguments through `packed` (slot addresses, then
// the result cell, then the kernel handles) and writes its launch status into the cell. The GIL is held for
// the whole call, so two Python threads never share a record's slots.

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using HostFn = void (*)(void**);
constexpr int64_t kInt32Limit = int64_t(1) << 31;

struct Launch {
  HostFn fn = nullptr;
  std::vector<uint64_t> slots;
  std::vector<void*> packed;
  int32_t result = 0;
};

// One compiled configuration on one device: the forward's default and register-capped ("wide") builds and the
// backward, with what the backward's persistent grid needs (launch.backward_grid).
struct Config {
  int64_t ratio, coff, head_dim, width, device;  // device: CUDA index
  Launch* fwd = nullptr;
  Launch* fwd_wide = nullptr;
  int64_t wide_rows = INT64_MAX;
  Launch* bwd = nullptr;
  int64_t capacity = 0, nchunk = 1, rows_per_step = 1, ws_cap_bytes = 0;
  bool stats = false;  // the softmax-statistics variants: the forward also returns them, the backward reads them
  PyObject* owned[3] = {nullptr, nullptr, nullptr};  // the launch capsules, kept alive by the configuration
};

void free_launch(PyObject* capsule) { delete static_cast<Launch*>(PyCapsule_GetPointer(capsule, "csa_launch")); }
void free_config(PyObject* capsule) {
  auto* cfg = static_cast<Config*>(PyCapsule_GetPointer(capsule, "csa_config"));
  for (PyObject* o : cfg->owned) Py_XDECREF(o);
  delete cfg;
}

bool as_i64(PyObject* o, int64_t* out) {
  *out = PyLong_AsLongLong(o);
  return !(*out == -1 && PyErr_Occurred());
}

// make_launch(host_fn_addr, packed_addr, n_slots, n_extra, has_result) -> capsule. The extras after the slot
// addresses are copied from the Python _Launcher's packed array, except the result cell, which is this record's.
PyObject* make_launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t fn, packed, n_slots, n_extra, has_result;
  if (nargs != 5 || !as_i64(args[0], &fn) || !as_i64(args[1], &packed) || !as_i64(args[2], &n_slots) ||
      !as_i64(args[3], &n_extra) || !as_i64(args[4], &has_result)) {
    PyErr_SetString(PyExc_TypeError, "make_launch(fn, packed, n_slots, n_extra, has_result): five ints");
    return nullptr;
  }
  auto* rec = new Launch();
  rec->fn = reinterpret_cast<HostFn>(fn);
  rec->slots.assign(n_slots, 0);
  rec->packed.resize(n_slots + n_extra);
  auto* src = reinterpret_cast<void**>(packed);
  for (int64_t i = 0; i < n_slots; ++i) rec->packed[i] = &rec->slots[i];
  for (int64_t i = 0; i < n_extra; ++i) rec->packed[n_slots + i] = src[n_slots + i];
  if (has_result) rec->packed[n_slots] = &rec->result;
  return PyCapsule_New(rec, "csa_launch", free_launch);
}

Launch* launch_of(PyObject* o) {
  return o == Py_None ? nullptr : static_cast<Launch*>(PyCapsule_GetPointer(o, "csa_launch"));
}

// make_config(ratio, coff, head_dim, device, fwd, fwd_wide, wide_rows, bwd, capacity, nchunk, rows_per_step,
// ws_cap_bytes, stats) -> capsule; fwd / fwd_wide / bwd: launch capsules or None; stats: 0 or 1.
PyObject* make_config(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 13) {
    PyErr_SetString(PyExc_TypeError, "make_config takes 13 arguments");
    return nullptr;
  }
  auto* cfg = new Config();
  int64_t stats = 0;
  bool ok = as_i64(args[0], &cfg->ratio) && as_i64(args[1], &cfg->coff) && as_i64(args[2], &cfg->head_dim) &&
            as_i64(args[3], &cfg->device) && as_i64(args[6], &cfg->wide_rows) && as_i64(args[8], &cfg->capacity) &&
            as_i64(args[9], &cfg->nchunk) && as_i64(args[10], &cfg->rows_per_step) &&
            as_i64(args[11], &cfg->ws_cap_bytes) && as_i64(args[12], &stats);
  cfg->stats = stats != 0;
  if (ok) {
    cfg->fwd = launch_of(args[4]);
    cfg->fwd_wide = launch_of(args[5]);
    cfg->bwd = launch_of(args[7]);
    ok = !PyErr_Occurred();
  }
  if (ok) {
    const int slots[3] = {4, 5, 7};
    for (int i = 0; i < 3; ++i) {
      if (args[slots[i]] != Py_None) {
        Py_INCREF(args[slots[i]]);
        cfg->owned[i] = args[slots[i]];
      }
    }
  }
  if (!ok) {
    delete cfg;
    return nullptr;
  }
  cfg->width = cfg->coff * cfg->head_dim;
  return PyCapsule_New(cfg, "csa_config", free_config);
}

const at::Tensor* tensor_of(PyObject* o) {
  return THPVariable_Check(o) ? &THPVariable_Unpack(o) : nullptr;
}

// device >= 0: that CUDA device; -1: the CPU (only check() is used with CPU configurations, by the tests).
bool on_device(const at::Tensor& t, const Config& cfg) {
  return cfg.device < 0 ? t.is_cpu() : (t.is_cuda() && t.get_device() == cfg.device);
}

bool aligned(const at::Tensor& t, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(t.data_ptr()) & (bytes - 1)) == 0;
}

// support._inputs_ok for CUDA configurations: the five inputs against the configuration.
bool inputs_ok(const Config& cfg, const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape,
               const at::Tensor& cu, const at::Tensor& cuc, int64_t rows) {
  if (kv.dim() != 2 || kv.size(1) != cfg.width || kv.scalar_type() != at::kBFloat16) return false;
  const int64_t tokens = kv.size(0);
  if (score.scalar_type() != at::kBFloat16 || score.sizes() != kv.sizes()) return false;
  if (ape.scalar_type() != at::kFloat || ape.dim() != 2 || ape.size(0) != cfg.ratio || ape.size(1) != cfg.width)
    return false;
  if (cu.scalar_type() != at::kInt || cuc.scalar_type() != at::kInt || cu.dim() != 1 || cu.size(0) < 2 ||
      cuc.sizes() != cu.sizes())
    return false;
  if (!kv.is_contiguous() || !score.is_contiguous() || !ape.is_contiguous() || !cu.is_contiguous() ||
      !cuc.is_contiguous())
    return false;
  if (!aligned(kv, 16) || !aligned(score, 16) || !aligned(ape, 16) || !aligned(cu, 4) || !aligned(cuc, 4))
    return false;
  if (tokens * cfg.width >= kInt32Limit || rows * cfg.head_dim >= kInt32Limit) return false;
  if (rows != 0 && tokens < cfg.ratio) return false;
  return on_device(kv, cfg) && on_device(score, cfg) && on_device(ape, cfg) && on_device(cu, cfg) &&
         on_device(cuc, cfg);
}

// support._buffer_ok: one caller-provided buffer (output or gradient).
bool buffer_ok(const at::Tensor& t, at::ScalarType dtype, const Config& cfg) {
  return t.scalar_type() == dtype && t.is_contiguous() && aligned(t, 16) && on_device(t, cfg);
}

// support.stats_ok: (rows, 3, head_dim) float32, contiguous, 16-byte aligned, on the device.
bool stats_ok(const at::Tensor& st, int64_t rows, const Config& cfg) {
  return st.dim() == 3 && st.size(0) == rows && st.size(1) == 3 && st.size(2) == cfg.head_dim &&
         buffer_ok(st, at::kFloat, cfg);
}

// An optional tensor argument: *out = the tensor or nullptr for None; false for anything else.
bool optional_tensor(PyObject* o, const at::Tensor** out) {
  *out = tensor_of(o);
  return *out != nullptr || o == Py_None;
}

// Pack the arguments into the record's slots (8 bytes each; Int32 as int32 plus 4 pad bytes) and call.
bool call(Launch* rec, const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints, int64_t stream) {
  size_t k = 0;
  for (uint64_t p : ptrs) rec->slots[k++] = p;
  for (int64_t v : ints) {
    if (v < -kInt32Limit || v >= kInt32Limit) {
      PyErr_SetString(PyExc_OverflowError, "cute host fast path: an Int32 argument is out of range");
      return false;
    }
    uint64_t slot = 0;
    const int32_t v32 = static_cast<int32_t>(v);
    std::memcpy(&slot, &v32, sizeof(v32));
    rec->slots[k++] = slot;
  }
  rec->slots[k] = static_cast<uint64_t>(stream);
  rec->result = 0;
  rec->fn(rec->packed.data());
  if (rec->result != 0) {
    PyErr_Format(PyExc_RuntimeError, "cute backend: kernel launch failed with CUDA error %d", int(rec->result));
    return false;
  }
  return true;
}

uint64_t ptr_of(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }


// Pack and call the forward (nothing to launch for zero rows; the register-capped build from wide_rows rows on): the
// inputs, out, the statistics (if any).
bool call_forward(const Config& cfg, const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape,
                  const at::Tensor& cu, const at::Tensor& cuc, const at::Tensor& out, const at::Tensor* st,
                  int64_t rows, int64_t stream) {
  if (rows == 0) return true;
  Launch* rec = (rows >= cfg.wide_rows && cfg.fwd_wide != nullptr) ? cfg.fwd_wide : cfg.fwd;
  std::vector<uint64_t> ptrs{ptr_of(kv), ptr_of(score), ptr_of(ape), ptr_of(cu), ptr_of(cuc), ptr_of(out)};
  if (st != nullptr) ptrs.push_back(ptr_of(*st));
  return call(rec, ptrs, {cu.size(0) - 1, rows}, stream);
}

// forward(config, kv, score, ape, cu_seqlens, cu_seqlens_comp, rows, stream) -> out (statistics configurations:
// (out, softmax_stats)), or None (slow path).
PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS  // at::empty may throw (out of memory): a Python exception, not std::terminate
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "forward takes 8 arguments");
    return nullptr;
  }
  auto* cfg = static_cast<Config*>(PyCapsule_GetPointer(args[0], "csa_config"));
  int64_t rows, stream;
  if (cfg == nullptr || !as_i64(args[6], &rows) || !as_i64(args[7], &stream)) return nullptr;
  const at::Tensor *kv = tensor_of(args[1]), *score = tensor_of(args[2]), *ape = tensor_of(args[3]);
  const at::Tensor *cu = tensor_of(args[4]), *cuc = tensor_of(args[5]);
  if (!kv || !score || !ape || !cu || !cuc || cfg->fwd == nullptr || rows < 0 ||
      !inputs_ok(*cfg, *kv, *score, *ape, *cu, *cuc, rows))
    Py_RETURN_NONE;
  at::Tensor out = at::empty({rows, cfg->head_dim}, kv->options());
  at::Tensor st;
  if (cfg->stats) st = at::empty({rows, 3, cfg->head_dim}, kv->options().dtype(at::kFloat));
  if (!call_forward(*cfg, *kv, *score, *ape, *cu, *cuc, out, cfg->stats ? &st : nullptr, rows, stream))
    return nullptr;
  if (!cfg->stats) return THPVariable_Wrap(std::move(out));
  PyObject* result = PyTuple_New(2);
  if (result == nullptr) return nullptr;
  PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(std::move(out)));
  PyTuple_SET_ITEM(result, 1, THPVariable_Wrap(std::move(st)));
  return result;
  END_HANDLE_TH_ERRORS
}

// forward_into(config, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, softmax_stats, stream) -> True (launched,
// or nothing to do for zero rows) or None (slow path): CSACompressorForward.execute with caller-provided buffers.
// softmax_stats: a buffer for statistics configurations, else None.
PyObject* forward_into(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "forward_into takes 9 arguments");
    return nullptr;
  }
  auto* cfg = static_cast<Config*>(PyCapsule_GetPointer(args[0], "csa_config"));
  int64_t stream;
  if (cfg == nullptr || !as_i64(args[8], &stream)) return nullptr;
  const at::Tensor *kv = tensor_of(args[1]), *score = tensor_of(args[2]), *ape = tensor_of(args[3]);
  const at::Tensor *cu = tensor_of(args[4]), *cuc = tensor_of(args[5]), *out = tensor_of(args[6]);
  const at::Tensor* st = nullptr;
  if (!optional_tensor(args[7], &st) || cfg->stats != (st != nullptr)) Py_RETURN_NONE;
  if (!kv || !score || !ape || !cu || !cuc || !out || cfg->fwd == nullptr || out->dim() != 2 ||
      out->size(1) != cfg->head_dim || !buffer_ok(*out, at::kBFloat16, *cfg))
    Py_RETURN_NONE;
  const int64_t rows = out->size(0);
  if (!inputs_ok(*cfg, *kv, *score, *ape, *cu, *cuc, rows) || (st != nullptr && !stats_ok(*st, rows, *cfg)))
    Py_RETURN_NONE;
  if (!call_forward(*cfg, *kv, *score, *ape, *cu, *cuc, *out, st, rows, stream)) return nullptr;
  Py_RETURN_TRUE;
}

// The backward's checks shared by backward and backward_into: grad_out and the inputs against the configuration
// (zero rows go to the Python path, which zeroes the gradients), the statistics of statistics configurations.
bool backward_inputs_ok(const Config& cfg, const at::Tensor* kv, const at::Tensor* score, const at::Tensor* ape,
                        const at::Tensor* cu, const at::Tensor* cuc, const at::Tensor* gout, const at::Tensor* st) {
  if (!kv || !score || !ape || !cu || !cuc || !gout || cfg.bwd == nullptr || cfg.stats != (st != nullptr) ||
      gout->dim() != 2 || gout->size(1) != cfg.head_dim || !buffer_ok(*gout, at::kBFloat16, cfg))
    return false;
  const int64_t n = gout->size(0);
  return n != 0 && inputs_ok(cfg, *kv, *score, *ape, *cu, *cuc, n) && (st == nullptr || stats_ok(*st, n, cfg));
}

// launch.backward_grid: fill the resident CTA slots once, with at most ws_cap_bytes of slabs; false when the
// slabs (ws_numel fp32) are too small for it.
bool backward_grid(const Config& cfg, int64_t n, int64_t ape_numel, int64_t ws_numel, int64_t* rows_per_cta,
                   int64_t* num_ctas) {
  const int64_t row_blocks = (n + cfg.rows_per_step - 1) / cfg.rows_per_step;
  const int64_t slabs_cap = std::max<int64_t>(1, cfg.ws_cap_bytes / (4 * ape_numel));
  const int64_t target_x = std::max<int64_t>(1, std::min({row_blocks, cfg.capacity / cfg.nchunk, slabs_cap}));
  const int64_t iters = (row_blocks + target_x - 1) / target_x;
  *rows_per_cta = iters * cfg.rows_per_step;
  *num_ctas = (n + *rows_per_cta - 1) / *rows_per_cta;
  return *num_ctas * ape_numel <= ws_numel;
}

// Pack and call the backward: the inputs, grad_out, the three gradients, the slabs, the statistics (if any).
bool call_backward(const Config& cfg, const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape,
                   const at::Tensor& cu, const at::Tensor& cuc, const at::Tensor& gout, const at::Tensor& gkv,
                   const at::Tensor& gsc, const at::Tensor& gape, int64_t ws_ptr, const at::Tensor* st,
                   int64_t rows_per_cta, int64_t num_ctas, int64_t stream) {
  std::vector<uint64_t> ptrs{ptr_of(kv),  ptr_of(score), ptr_of(ape), ptr_of(cu),
                             ptr_of(cuc), ptr_of(gout),  ptr_of(gkv), ptr_of(gsc),
                             ptr_of(gape), static_cast<uint64_t>(ws_ptr)};
  if (st != nullptr) ptrs.push_back(ptr_of(*st));
  return call(cfg.bwd, ptrs, {cu.size(0) - 1, gout.size(0), kv.size(0), rows_per_cta, num_ctas}, stream);
}

// backward(config, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, softmax_stats, stream, ws_ptr, ws_numel)
// -> (grad_kv, grad_score, grad_ape), or None (slow path; also when the slabs ws are too small). softmax_stats: the
// forward's statistics for statistics configurations, else None.
PyObject* backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError, "backward takes 11 arguments");
    return nullptr;
  }
  auto* cfg = static_cast<Config*>(PyCapsule_GetPointer(args[0], "csa_config"));
  int64_t stream, ws_ptr, ws_numel;
  if (cfg == nullptr || !as_i64(args[8], &stream) || !as_i64(args[9], &ws_ptr) || !as_i64(args[10], &ws_numel))
    return nullptr;
  const at::Tensor *kv = tensor_of(args[1]), *score = tensor_of(args[2]), *ape = tensor_of(args[3]);
  const at::Tensor *cu = tensor_of(args[4]), *cuc = tensor_of(args[5]), *gout = tensor_of(args[6]);
  const at::Tensor* st = nullptr;
  if (!optional_tensor(args[7], &st) || !backward_inputs_ok(*cfg, kv, score, ape, cu, cuc, gout, st)) Py_RETURN_NONE;
  int64_t rows_per_cta, num_ctas;
  if (!backward_grid(*cfg, gout->size(0), ape->numel(), ws_numel, &rows_per_cta, &num_ctas)) Py_RETURN_NONE;
  at::Tensor gkv = at::empty(kv->sizes(), kv->options());
  at::Tensor gsc = at::empty(score->sizes(), score->options());
  at::Tensor gape = at::empty(ape->sizes(), ape->options());
  if (!call_backward(*cfg, *kv, *score, *ape, *cu, *cuc, *gout, gkv, gsc, gape, ws_ptr, st, rows_per_cta, num_ctas,
                     stream))
    return nullptr;
  PyObject* result = PyTuple_New(3);
  if (result == nullptr) return nullptr;
  PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(std::move(gkv)));
  PyTuple_SET_ITEM(result, 1, THPVariable_Wrap(std::move(gsc)));
  PyTuple_SET_ITEM(result, 2, THPVariable_Wrap(std::move(gape)));
  return result;
  END_HANDLE_TH_ERRORS
}

// backward_into(config, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape,
// softmax_stats, stream, ws_ptr, ws_numel) -> True or None (slow path): CSACompressorBackward.execute with
// caller-provided gradients (support.recheck_backward's checks of them).
PyObject* backward_into(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "backward_into takes 14 arguments");
    return nullptr;
  }
  auto* cfg = static_cast<Config*>(PyCapsule_GetPointer(args[0], "csa_config"));
  int64_t stream, ws_ptr, ws_numel;
  if (cfg == nullptr || !as_i64(args[11], &stream) || !as_i64(args[12], &ws_ptr) || !as_i64(args[13], &ws_numel))
    return nullptr;
  const at::Tensor *kv = tensor_of(args[1]), *score = tensor_of(args[2]), *ape = tensor_of(args[3]);
  const at::Tensor *cu = tensor_of(args[4]), *cuc = tensor_of(args[5]), *gout = tensor_of(args[6]);
  const at::Tensor *gkv = tensor_of(args[7]), *gsc = tensor_of(args[8]), *gape = tensor_of(args[9]);
  const at::Tensor* st = nullptr;
  if (!optional_tensor(args[10], &st) || !backward_inputs_ok(*cfg, kv, score, ape, cu, cuc, gout, st) || !gkv ||
      !gsc || !gape || gkv->sizes() != kv->sizes() || gsc->sizes() != kv->sizes() || gape->sizes() != ape->sizes() ||
      !buffer_ok(*gkv, at::kBFloat16, *cfg) || !buffer_ok(*gsc, at::kBFloat16, *cfg) ||
      !buffer_ok(*gape, at::kFloat, *cfg))
    Py_RETURN_NONE;
  int64_t rows_per_cta, num_ctas;
  if (!backward_grid(*cfg, gout->size(0), ape->numel(), ws_numel, &rows_per_cta, &num_ctas)) Py_RETURN_NONE;
  if (!call_backward(*cfg, *kv, *score, *ape, *cu, *cuc, *gout, *gkv, *gsc, *gape, ws_ptr, st, rows_per_cta,
                     num_ctas, stream))
    return nullptr;
  Py_RETURN_TRUE;
}

// check(config, kv, score, ape, cu_seqlens, cu_seqlens_comp, rows) -> bool: the forward's input checks alone
// (tests compare them with support._inputs_ok).
PyObject* check(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "check takes 7 arguments");
    return nullptr;
  }
  auto* cfg = static_cast<Config*>(PyCapsule_GetPointer(args[0], "csa_config"));
  int64_t rows;
  if (cfg == nullptr || !as_i64(args[6], &rows)) return nullptr;
  const at::Tensor *kv = tensor_of(args[1]), *score = tensor_of(args[2]), *ape = tensor_of(args[3]);
  const at::Tensor *cu = tensor_of(args[4]), *cuc = tensor_of(args[5]);
  if (kv && score && ape && cu && cuc && inputs_ok(*cfg, *kv, *score, *ape, *cu, *cuc, rows)) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

// call(launch, ptrs, ints, stream): the packed call alone (tests check the slot layout with it).
PyObject* call_packed(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "call(launch, ptrs: tuple, ints: tuple, stream)");
    return nullptr;
  }
  Launch* rec = launch_of(args[0]);
  int64_t stream;
  if (rec == nullptr || !as_i64(args[3], &stream)) return nullptr;
  std::vector<uint64_t> ptrs;
  std::vector<int64_t> ints;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); ++i) {
    ptrs.push_back(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args[1], i)));
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[2]); ++i) {
    int64_t v;
    if (!as_i64(PyTuple_GET_ITEM(args[2], i), &v)) return nullptr;
    ints.push_back(v);
  }
  if (PyErr_Occurred()) return nullptr;
  if (ptrs.size() + ints.size() + 1 != rec->slots.size()) {
    PyErr_SetString(PyExc_ValueError, "call: argument count does not match the record's slots");
    return nullptr;
  }
  if (!call(rec, ptrs, ints, stream)) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"make_launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(make_launch)), METH_FASTCALL, nullptr},
    {"make_config", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(make_config)), METH_FASTCALL, nullptr},
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(forward)), METH_FASTCALL, nullptr},
    {"backward", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(backward)), METH_FASTCALL, nullptr},
    {"forward_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(forward_into)), METH_FASTCALL, nullptr},
    {"backward_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(backward_into)), METH_FASTCALL,
     nullptr},
    {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(check)), METH_FASTCALL, nullptr},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(call_packed)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "csa_cute_host", "cute backend host fast path", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_csa_cute_host() { return PyModule_Create(&kModule); }
