// NVSHMEM device API for NVRTC-compiled kernels. Include this (never NVSHMEM's headers directly),
// once per translation unit: every kernel source is its own module, and in link mode "inline" this
// header defines the module's NVSHMEM device-state symbols.
//
// The JIT (epcomm.runtime.options, from EPCOMM_NVSHMEM_LINK) defines one of:
//   EPCOMM_NVSHMEM_INLINE: all NVSHMEM device code comes from the headers; IBGDA is compiled out
//                          (its headers need infiniband/mlx5dv.h), so non-NVLink peers go through
//                          NVSHMEM's CPU proxy. Nothing is linked from NVSHMEM's device library.
//   EPCOMM_NVSHMEM_LIB:    NVSHMEM internals come from libnvshmem_device.a through nvJitLink
//                          (keeps GPU-initiated IBGDA), with the uint64_t mangling shim below.
// After loading, epcomm.runtime.nvshmem.cumodule_init fills the device state (nvshmemx_cumodule_init).
#pragma once

#if defined(EPCOMM_NVSHMEM_INLINE) == defined(EPCOMM_NVSHMEM_LIB)
#error "define exactly one of EPCOMM_NVSHMEM_INLINE / EPCOMM_NVSHMEM_LIB (KernelSource.uses_nvshmem does)"
#endif

// NVSHMEM's NVRTC path spells some traits std::is_integral / std::is_same; under NVRTC only libcu++
// (cuda::std) exists.
#include <cuda/std/type_traits>
namespace std { using namespace cuda::std; }

#if defined(EPCOMM_NVSHMEM_INLINE)
#define NVSHMEM_ENABLE_ALL_DEVICE_INLINING
// The wheel's build options enable IBGDA; drop it here. IBGDA only changes transfer code, not the
// layout of the device state that nvshmemx_cumodule_init fills in.
#include "non_abi/nvshmem_build_options.h"
#undef NVSHMEM_IBGDA_SUPPORT
#undef NVSHMEM_IBGDA_SUPPORT_GPUMEM_ONLY
#endif

// Point-to-point RMA, signals, quiet/fence and nvshmem_ptr only: NVRTC is ~3x faster than with
// <nvshmem.h>, which pulls in every collective.
#include "device/nvshmem_defines.h"
#include "device/nvshmemx_defines.h"

#if defined(EPCOMM_NVSHMEM_INLINE)
// The headers only declare these (extern __constant__ under -rdc); nvshmemx_cumodule_init finds
// them by name with cuModuleGetGlobal.
__constant__ nvshmemi_device_host_state_t nvshmemi_device_state_d;
__constant__ nvshmemi_version_t nvshmemi_device_lib_version_d = {
    NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
#else
// ABI shim: libnvshmem_device.a was built by nvcc with glibc's uint64_t = unsigned long (mangled
// 'm'); under NVRTC libcu++'s uint64_t is unsigned long long ('y'), so the headers' reference to
// the library's put-with-signal function would not resolve. Define the 'y' flavour the headers
// declare as a forward to the 'm' one the library exports: the only out-of-line library function
// with a uint64_t parameter that point-to-point code reaches. Its name and parameters by release:
//   3.4:      nvshmemi_transfer_put_signal<S>(..., signal, sig_op, pe, is_nbi)
//   3.5-3.7:  nvshmemi_transfer_put_signal<S>(..., signal, sig_op, pe, is_nbi, qp_index)
//   3.8+:     nvshmemi_transfer_put_signal_dispatch<S>(..., same), put_signal an inline wrapper
#define EPCOMM_NVSHMEM_AT_LEAST(major, minor)                                                  \
    (NVSHMEM_VENDOR_MAJOR_VERSION > (major) ||                                                 \
     (NVSHMEM_VENDOR_MAJOR_VERSION == (major) && NVSHMEM_VENDOR_MINOR_VERSION >= (minor)))
#if EPCOMM_NVSHMEM_AT_LEAST(3, 8)
#define EPCOMM_PUT_SIGNAL_OUT_OF_LINE nvshmemi_transfer_put_signal_dispatch
#else
#define EPCOMM_PUT_SIGNAL_OUT_OF_LINE nvshmemi_transfer_put_signal
#endif
#if EPCOMM_NVSHMEM_AT_LEAST(3, 5)
#define EPCOMM_PUT_SIGNAL_QP_PARAM , nvshmemx_qp_handle_t qp_index
#define EPCOMM_PUT_SIGNAL_QP_ARG , qp_index
#else
#define EPCOMM_PUT_SIGNAL_QP_PARAM
#define EPCOMM_PUT_SIGNAL_QP_ARG
#endif
template <threadgroup_t SCOPE>
__device__ void EPCOMM_PUT_SIGNAL_OUT_OF_LINE(void *rptr, void *lptr, size_t bytes, void *sig_addr,
                                              unsigned long signal, nvshmemi_amo_t sig_op, int pe,
                                              bool is_nbi EPCOMM_PUT_SIGNAL_QP_PARAM);
template <threadgroup_t SCOPE>
__device__ void EPCOMM_PUT_SIGNAL_OUT_OF_LINE(void *rptr, void *lptr, size_t bytes, void *sig_addr,
                                              unsigned long long signal, nvshmemi_amo_t sig_op,
                                              int pe, bool is_nbi EPCOMM_PUT_SIGNAL_QP_PARAM) {
    EPCOMM_PUT_SIGNAL_OUT_OF_LINE<SCOPE>(rptr, lptr, bytes, sig_addr,
                                         static_cast<unsigned long>(signal), sig_op, pe,
                                         is_nbi EPCOMM_PUT_SIGNAL_QP_ARG);
}
#endif
