// Chunk-request case generator (outside the project): a given model, the chunk request of
// kaldi_stats.json (input t in [-left, chunk + right), output t in [0, chunk), n in
// [0, batch), i-vector at t = 0 per n), compiled, optimized and computed by Kaldi; written
// in the kaldi-ref network case layout, plus shortcut.json: the stats of the computation
// CachingOptimizingCompiler makes (shortcut compilation for batch > 1).
#include "nnet3/nnet-nnet.h"
#include "nnet3/nnet-compile.h"
#include "nnet3/nnet-optimize.h"
#include "nnet3/nnet-compute.h"
#include "nnet3/nnet-utils.h"
#include "nnet3/am-nnet-simple.h"
#include "hmm/transition-model.h"
#include "oracle_io.h"
#include <fstream>
#include <cstdio>
using namespace kaldi;
using namespace kaldi::nnet3;

int main(int argc, char **argv) {
  // OPTSEED (optional): optimize with options drawn at random from it (RandomOptimizeOptions,
  // written to options.json) instead of the defaults, here and in the caching compiler
  // TRAIN (optional, 1): batch-norm in training mode and the request storing component
  // statistics; the network after the run is written to model_after.txt (OPTSEED -1:
  // the default options)
  if (argc < 6 || argc > 8) {
    fprintf(stderr, "genchunk MODEL CHUNK BATCH DERIV OUTDIR [OPTSEED [TRAIN]]\n"); return 1;
  }
  bool train = argc == 8 && atoi(argv[7]) == 1;
  std::string dir = argv[5];
  int chunk = atoi(argv[2]), batch = atoi(argv[3]);
  bool deriv = atoi(argv[4]) != 0;
  SetVerboseLevel(-1);
  srand(chunk * 1000 + batch * 10 + deriv);
  Nnet nnet;
  {
    std::string model = argv[1];
    bool binary; Input ki(model, &binary);
    // .mdl: the network after the transition model (as nnet3-compute reads it)
    if (model.size() > 4 && model.substr(model.size() - 4) == ".mdl") {
      TransitionModel tm; tm.Read(ki.Stream(), binary);
      AmNnetSimple am; am.Read(ki.Stream(), binary); nnet = am.GetNnet();
    } else nnet.Read(ki.Stream(), binary);
  }
  SetBatchnormTestMode(!train, &nnet);
  SetDropoutTestMode(true, &nnet);
  int32 left, right;
  ComputeSimpleNnetContext(nnet, &left, &right);
  ComputationRequest request;
  request.inputs.resize(1);
  request.inputs[0].name = "input";
  request.inputs[0].has_deriv = deriv;
  for (int n = 0; n < batch; n++)
    for (int t = -left; t < chunk + right; t++) request.inputs[0].indexes.push_back(Index(n, t, 0));
  if (nnet.GetNodeIndex("ivector") >= 0) {
    IoSpecification iv;
    iv.name = "ivector";
    for (int n = 0; n < batch; n++) iv.indexes.push_back(Index(n, 0, 0));
    request.inputs.push_back(iv);
  }
  request.outputs.resize(1);
  request.outputs[0].name = "output";
  request.outputs[0].has_deriv = deriv;
  for (int n = 0; n < batch; n++)
    for (int t = 0; t < chunk; t++) request.outputs[0].indexes.push_back(Index(n, t, 0));
  request.need_model_derivative = deriv;
  request.store_component_stats = train;
  // model.txt, model_grad.txt, model_after.txt with 9 digits (a float exactly; a plain
  // ofstream has 6, and nnetc would then run a model rounded from the one computed here)
  { std::ofstream mf((dir + "/model.txt").c_str()); mf.precision(9); nnet.Write(mf, false); }
  { std::ofstream rf((dir + "/request.json").c_str()); WriteRequest(rf, request); }
  NnetComputation unopt, comp;
  { Compiler compiler(request, nnet); CompilerOptions opts; compiler.CreateComputation(opts, &unopt); }
  comp = unopt;
  NnetOptimizeOptions oo;
  if (argc >= 7 && atoi(argv[6]) >= 0)
    RandomOptimizeOptions((unsigned)atoi(argv[6]), request, dir + "/options.json", &oo);
  Optimize(oo, nnet, MaxOutputTimeInRequest(request), &comp);
  comp.ComputeCudaIndexes();
  { std::ofstream sf((dir + "/stats.json").c_str());
    sf << "{\"optimized\": "; Stats(comp, sf); sf << ", \"unoptimized\": "; Stats(unopt, sf); sf << "}\n"; }
  { std::ofstream pf((dir + "/computation.txt").c_str()); comp.Print(pf, nnet); }
  {
    CachingOptimizingCompilerOptions copts;
    CachingOptimizingCompiler caching(nnet, oo, copts);
    std::shared_ptr<const NnetComputation> c = caching.Compile(request);
    std::ofstream sf((dir + "/shortcut.json").c_str());
    Stats(*c, sf); sf << "\n";
  }
  Nnet grad_nnet(nnet);
  if (deriv) SetNnetAsGradient(&grad_nnet);
  NnetComputeOptions copts;
  NnetComputer computer(copts, comp, &nnet, &grad_nnet);
  std::ofstream af((dir + "/arrays.txt").c_str());
  for (size_t i = 0; i < request.inputs.size(); i++) {
    Matrix<BaseFloat> in(request.inputs[i].indexes.size(), nnet.InputDim(request.inputs[i].name));
    in.SetRandn();
    WriteMat(af, "input." + request.inputs[i].name, in);
    CuMatrix<BaseFloat> cu(in);
    computer.AcceptInput(request.inputs[i].name, &cu);
  }
  computer.Run();
  Matrix<BaseFloat> om(computer.GetOutput("output"));
  WriteMat(af, "output.output", om);
  if (deriv) {
    Matrix<BaseFloat> d(om.NumRows(), om.NumCols());
    d.SetRandn();
    WriteMat(af, "output_deriv.output", d);
    CuMatrix<BaseFloat> cu(d);
    computer.AcceptInput("output", &cu);
    computer.Run();
    CuMatrix<BaseFloat> di;
    computer.GetOutputDestructive("input", &di);
    Matrix<BaseFloat> dm(di);
    WriteMat(af, "input_deriv.input", dm);
    std::ofstream gf((dir + "/model_grad.txt").c_str()); gf.precision(9); grad_nnet.Write(gf, false);
  }
  if (train) { std::ofstream sf((dir + "/model_after.txt").c_str()); sf.precision(9); nnet.Write(sf, false); }
  return 0;
}
