// Reference-case generator (outside the project): Kaldi's random network + request,
// compiled, optimized, computed; written in the kaldi-ref case format (arrays as text).
#include "nnet3/nnet-nnet.h"
#include "nnet3/nnet-test-utils.h"
#include "nnet3/nnet-compile.h"
#include "nnet3/nnet-optimize.h"
#include "nnet3/nnet-compute.h"
#include "nnet3/nnet-utils.h"
#include "oracle_io.h"
#include <fstream>
#include <sstream>
#include <cstdio>
using namespace kaldi;
using namespace kaldi::nnet3;

int main(int argc, char **argv) {
  if (argc != 3 && argc != 4) { fprintf(stderr, "gen SEED OUTDIR [OPTIONS]\n"); return 1; }
  int seed = atoi(argv[1]);
  std::string dir = argv[2];
  // OPTIONS: 1 turns on allow_ivector, which NnetGenerationOptions leaves off by default
  // (its other default-off option, allow_multiple_outputs, no generator reads); 2 draws
  // the optimizer options at random (each switch off with probability 0.3, sometimes a
  // derivative-time window, memory compression 0-3) from their own generator, so the
  // network and request are those of the same seed without it; written to options.json;
  // 4 leaves batch-norm in training mode (its outputs and derivatives then come from the
  // minibatch's own statistics, which it also stores)
  int flags = argc == 4 ? atoi(argv[3]) : 0;
  srand(seed);
  SetVerboseLevel(-1);
  NnetGenerationOptions gen_opts;
  gen_opts.allow_ivector = (flags & 1) != 0;
  std::vector<std::string> configs;
  GenerateConfigSequence(gen_opts, &configs);
  Nnet nnet;
  {
    std::ofstream cf((dir + "/configs.txt").c_str());
    for (size_t j = 0; j < configs.size(); j++) {
      cf << configs[j];
      std::istringstream is(configs[j]);
      nnet.ReadConfig(is);
    }
  }
  ComputationRequest request;
  std::vector<Matrix<BaseFloat> > inputs;
  ComputeExampleComputationRequestSimple(nnet, &request, &inputs);
  if ((flags & 4) == 0) SetBatchnormTestMode(true, &nnet);
  SetDropoutTestMode(true, &nnet);
  { std::ofstream mf((dir + "/model.txt").c_str()); nnet.Write(mf, false); }
  { std::ofstream rf((dir + "/request.json").c_str()); WriteRequest(rf, request); }
  NnetComputation unopt, comp;
  { Compiler compiler(request, nnet); CompilerOptions opts; compiler.CreateComputation(opts, &unopt); }
  comp = unopt;
  NnetOptimizeOptions oo;
  if (flags & 2)
    RandomOptimizeOptions(seed * 7919u + 17u, request, dir + "/options.json", &oo);
  Optimize(oo, nnet, MaxOutputTimeInRequest(request), &comp);
  comp.ComputeCudaIndexes();
  { std::ofstream sf((dir + "/stats.json").c_str());
    sf << "{\"optimized\": "; Stats(comp, sf); sf << ", \"unoptimized\": "; Stats(unopt, sf); sf << "}\n"; }
  { std::ofstream pf((dir + "/computation.txt").c_str()); comp.Print(pf, nnet); }
  Nnet grad_nnet(nnet);
  if (request.need_model_derivative) SetNnetAsGradient(&grad_nnet);
  NnetComputeOptions copts;
  NnetComputer computer(copts, comp, &nnet, &grad_nnet);
  std::ofstream af((dir + "/arrays.txt").c_str());
  for (size_t i = 0; i < request.inputs.size(); i++) {
    WriteMat(af, "input." + request.inputs[i].name, inputs[i]);
    CuMatrix<BaseFloat> cu(inputs[i]);
    computer.AcceptInput(request.inputs[i].name, &cu);
  }
  computer.Run();
  bool any_deriv = false;
  for (size_t i = 0; i < request.outputs.size(); i++) {
    const CuMatrixBase<BaseFloat> &o = computer.GetOutput(request.outputs[i].name);
    Matrix<BaseFloat> om(o);
    WriteMat(af, "output." + request.outputs[i].name, om);
    if (request.outputs[i].has_deriv) any_deriv = true;
  }
  if (any_deriv) {
    for (size_t i = 0; i < request.outputs.size(); i++) {
      if (!request.outputs[i].has_deriv) continue;
      const CuMatrixBase<BaseFloat> &o = computer.GetOutput(request.outputs[i].name);
      Matrix<BaseFloat> d(o.NumRows(), o.NumCols());
      d.SetRandn();
      WriteMat(af, "output_deriv." + request.outputs[i].name, d);
      CuMatrix<BaseFloat> cu(d);
      computer.AcceptInput(request.outputs[i].name, &cu);
    }
    computer.Run();
    for (size_t i = 0; i < request.inputs.size(); i++) {
      if (!request.inputs[i].has_deriv) continue;
      CuMatrix<BaseFloat> d;
      computer.GetOutputDestructive(request.inputs[i].name, &d);
      Matrix<BaseFloat> dm(d);
      WriteMat(af, "input_deriv." + request.inputs[i].name, dm);
    }
    if (request.need_model_derivative) {
      std::ofstream gf((dir + "/model_grad.txt").c_str()); grad_nnet.Write(gf, false);
    }
  }
  // with store_component_stats, the statistics the components stored while the
  // computation ran (the computer was given &nnet to store them in)
  if (request.store_component_stats) {
    std::ofstream sf((dir + "/model_after.txt").c_str()); nnet.Write(sf, false);
  }
  return 0;
}
