// The interface between the CPU ops (embedding_cpu.cpp) and the row kernels
// (kernels.h), which are compiled once per instruction set: kernels_base.cpp for any
// x86-64 / ARM CPU, kernels_avx2.cpp with AVX2+FMA+F16C, kernels_avx512.cpp with AVX-512
// F/BW/VL/DQ. The op picks one table at run time, as PyTorch's own CPU kernels do
// (DispatchStub).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "../common.h"
#include "../dropout.h"

namespace pyembed::cpu {

// Tokens grouped by key (an id, or a position): segment s holds the token indices
// order[begin[s] .. begin[s+1]), in increasing order, all with key rows[s]; rows ascend.
struct Segments {
  std::vector<int64_t> rows, begin, order;
  int64_t size() const { return static_cast<int64_t>(rows.size()); }
  int64_t count(int64_t s) const { return begin[s + 1] - begin[s]; }
};

struct ForwardArgs {
  const void* ids;              // (num_tokens,) int32 / int64, contiguous
  c10::ScalarType id_type;
  const void* weight;           // (num_embeddings, dim) of dtype
  const void* pos_weight;       // (num_positions, dim) of dtype, learned mode only
  const int64_t* position_ids;  // (num_tokens,) or nullptr: p = offset + t
  c10::ScalarType dtype;
  PosEncoding mode;
  double scale;
  int64_t offset, num_tokens, seq_len, num_embeddings, num_positions, dim;
  int64_t sinusoid_column_offset, sinusoid_dim;  // columns of a wider sinusoid (ForwardInputs)
  Dropout dropout;              // applied to the sum, before the rounding (inactive: none)
  void* out;                    // (num_tokens, dim) of dtype
};

// out row dest(s) = round(factor(s) * sum of dout rows of segment s), where dest(s) is
// dest_rows[s] (dense gradient) or s (sparse values) and factor is scale [/ count].
struct SegmentSumArgs {
  const Segments* segments;
  const void* dout;             // (num_tokens, dim) of dtype
  c10::ScalarType dtype;
  int64_t dim;
  double scale;
  bool divide_by_count;
  const int64_t* dest_rows;     // nullptr: row s
  void* out;
};

// out[offset + t] = sum over b of dout[b, t] for t < steps (learned positions, p = offset + t).
struct BatchSumArgs {
  const void* dout;             // (batch, seq_len, dim) of dtype
  c10::ScalarType dtype;
  int64_t batch, seq_len, steps, offset, dim;
  void* out;                    // (num_positions, dim)
};

// The optimizer inside the backward (csrc/optim.h): rows[k] of the table got the gradient
// row values[k]; all_rows: every table row is updated, the others with g = 0 (dense
// semantics), else only the rows listed.
struct OptimizerArgs {
  void* param;                  // (num_rows, dim) of dtype, updated in place
  void* state1;                 // (num_rows, dim) of dtype, or nullptr when the rule keeps none
  void* state2;
  const int64_t* rows;          // (touched,) ascending, unique
  const void* values;           // (touched, dim) of dtype
  c10::ScalarType dtype;
  int64_t num_rows, touched, dim;
  int rule;                     // optim::Rule
  const double* hyper;          // the rule's host scalars (optim::Scalars::from)
  bool all_rows;
};

struct Kernels {
  const char* isa;
  void (*forward)(const ForwardArgs&);
  void (*segment_sum)(const SegmentSumArgs&);
  void (*batch_sum)(const BatchSumArgs&);
  void (*optimizer_update)(const OptimizerArgs&);
};

const Kernels& kernels_base();
const Kernels* kernels_avx2();    // nullptr when not compiled for this architecture
const Kernels* kernels_avx512();  // nullptr when not compiled for this architecture
const Kernels& row_kernels();     // the best of the three this CPU can run

}  // namespace pyembed::cpu
