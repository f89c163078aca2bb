// What the drivers write for the Python side (oracle_io.py): text matrices ("name rows
// cols", then rows), the stats.json figures of a computation, request.json.
#ifndef NNETC_KALDI_ORACLE_IO_H_
#define NNETC_KALDI_ORACLE_IO_H_
#include "matrix/kaldi-matrix.h"
#include "nnet3/nnet-computation.h"
#include "nnet3/nnet-optimize.h"
#include <algorithm>
#include <fstream>
#include <random>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

inline void WriteMat(std::ostream &os, const std::string &name,
                     const kaldi::MatrixBase<kaldi::BaseFloat> &m) {
  os << name << " " << m.NumRows() << " " << m.NumCols() << "\n";
  char buf[64];
  for (int r = 0; r < m.NumRows(); r++) {
    for (int c = 0; c < m.NumCols(); c++) { snprintf(buf, 64, "%.9g ", m(r, c)); os << buf; }
    os << "\n";
  }
}

namespace kaldi {
namespace nnet3 {

// Command count (no-ops left out) and peak float32 bytes allocated and not yet freed, as in
// stats.json.
inline void Stats(const NnetComputation &c, std::ostream &os) {
  int64 cmds = 0, cur = 0, peak = 0;
  for (size_t i = 0; i < c.commands.size(); i++) {
    const NnetComputation::Command &cmd = c.commands[i];
    if (cmd.command_type == kNoOperation || cmd.command_type == kNoOperationPermanent) continue;
    cmds++;
    if (cmd.command_type == kAllocMatrix || cmd.command_type == kDeallocMatrix) {
      int32 m = c.submatrices[cmd.arg1].matrix_index;
      int64 b = 4LL * c.matrices[m].num_rows * c.matrices[m].num_cols;
      cur += (cmd.command_type == kAllocMatrix ? b : -b);
      if (cur > peak) peak = cur;
    }
  }
  os << "{\"commands\": " << cmds << ", \"peak_bytes\": " << peak << "}";
}

inline void WriteIoList(std::ostream &os, const std::vector<IoSpecification> &list) {
  for (size_t i = 0; i < list.size(); i++) {
    const IoSpecification &s = list[i];
    os << (i ? ", " : "") << "{\"name\": \"" << s.name << "\", \"has_deriv\": " << (s.has_deriv ? "true" : "false") << ", \"indexes\": [";
    for (size_t j = 0; j < s.indexes.size(); j++)
      os << (j ? ", " : "") << "[" << s.indexes[j].n << ", " << s.indexes[j].t << ", " << s.indexes[j].x << "]";
    os << "]}";
  }
}

// A ComputationRequest as request.json.
inline void WriteRequest(std::ostream &os, const ComputationRequest &r) {
  os << "{\"inputs\": [";
  WriteIoList(os, r.inputs);
  os << "], \"outputs\": [";
  WriteIoList(os, r.outputs);
  os << "], \"need_model_derivative\": " << (r.need_model_derivative ? "true" : "false")
     << ", \"store_component_stats\": " << (r.store_component_stats ? "true" : "false") << "}";
}


// Optimizer options drawn at random from rng_seed (each switch off with probability 0.3,
// "optimize" itself 0.05; a derivative-time window within the request's output times in 4
// cases of 10; memory compression 0-3), written to json_path with our OptimizeOptions names.
// With window false no derivative-time window is drawn (a computation without derivatives).
inline void RandomOptimizeOptions(unsigned rng_seed, const ComputationRequest &request,
                                  const std::string &json_path, NnetOptimizeOptions *oo,
                                  bool window = true) {
  std::mt19937 rng(rng_seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  bool *sw[] = {&oo->optimize, &oo->consolidate_model_update, &oo->propagate_in_place,
                &oo->backprop_in_place, &oo->optimize_row_ops, &oo->split_row_ops,
                &oo->extend_matrices, &oo->convert_addition, &oo->remove_assignments,
                &oo->allow_left_merge, &oo->allow_right_merge, &oo->initialize_undefined,
                &oo->move_sizing_commands, &oo->allocate_from_other, &oo->snip_row_ops};
  const char *names[] = {"optimize", "consolidate_model_update", "propagate_in_place",
                         "backprop_in_place", "optimize_row_ops", "split_row_ops",
                         "extend_matrices", "convert_addition", "remove_assignments",
                         "allow_left_merge", "allow_right_merge", "initialize_undefined",
                         "move_sizing_commands", "allocate_from_other", "snip_row_ops"};
  std::ofstream of(json_path.c_str());
  of << "{";
  for (int i = 0; i < 15; i++) {
    // "optimize" itself off rarely: it turns nearly every pass off at once
    *sw[i] = u(rng) >= (i == 0 ? 0.05 : 0.3);
    of << "\"" << names[i] << "\": " << (*sw[i] ? "true" : "false") << ", ";
  }
  int t_lo = 1 << 30, t_hi = -(1 << 30);
  for (size_t i = 0; i < request.outputs.size(); i++)
    for (size_t j = 0; j < request.outputs[i].indexes.size(); j++) {
      t_lo = std::min(t_lo, request.outputs[i].indexes[j].t);
      t_hi = std::max(t_hi, request.outputs[i].indexes[j].t);
    }
  double r = window ? u(rng) : 1.0;
  if (r < 0.15) {
    oo->min_deriv_time = t_lo + (int)(u(rng) * (t_hi - t_lo + 1));
    of << "\"min_deriv_time\": " << oo->min_deriv_time << ", ";
  } else if (r < 0.3) {
    oo->max_deriv_time = t_lo + (int)(u(rng) * (t_hi - t_lo + 1));
    of << "\"max_deriv_time\": " << oo->max_deriv_time << ", ";
  } else if (r < 0.4) {
    oo->max_deriv_time_relative = -(int)(u(rng) * 3);
    of << "\"max_deriv_time_relative\": " << oo->max_deriv_time_relative << ", ";
  }
  oo->memory_compression_level = (int)(u(rng) * 4);
  of << "\"memory_compression_level\": " << oo->memory_compression_level << "}\n";
}

}  // namespace nnet3
}  // namespace kaldi
#endif
