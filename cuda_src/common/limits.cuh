// Limits every kernel family shares; the host reads them from here (epcomm.runtime.cuda_decls).
#pragma once

namespace epcomm {

constexpr int kMaxTopk = 32;        // top-k slots of a token: the kernels give each slot one lane
constexpr int kDataThreads = 512;   // threads per block of every family's data kernels (16 warps)

}  // namespace epcomm
