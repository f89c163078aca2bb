// geninfer MODEL IN.txt OUT.txt looped(0/1) fpc elc erc elci ercf fsf period [OPTSEED]
// OPTSEED: the looped computation is optimized with options drawn at random from it
// (RandomOptimizeOptions without a derivative window, written to OUT.txt.options.json)
// IN.txt: "features R C" rows, optional "ivector 1 D", optional "online R C"
#include "nnet3/nnet-am-decodable-simple.h"
#include "nnet3/decodable-simple-looped.h"
#include "nnet3/nnet-utils.h"
#include "oracle_io.h"
#include <fstream>
#include <map>
#include <cstdio>
using namespace kaldi;
using namespace kaldi::nnet3;
int main(int argc, char **argv) {
  SetVerboseLevel(-1);
  std::string model = argv[1];
  Nnet nnet;
  {
    bool binary; Input ki(model, &binary);
    // .mdl: skip the transition model (as nnet3-compute via AmNnetSimple)
    if (model.size() > 4 && model.substr(model.size() - 4) == ".mdl") {
      TransitionModel tm; tm.Read(ki.Stream(), binary);
      AmNnetSimple am; am.Read(ki.Stream(), binary); nnet = am.GetNnet();
    } else nnet.Read(ki.Stream(), binary);
  }
  std::map<std::string, Matrix<BaseFloat> > in;
  { std::ifstream f(argv[2]); std::string name; int r, c;
    while (f >> name >> r >> c) { Matrix<BaseFloat> m(r, c); for (int i = 0; i < r; i++) for (int j = 0; j < c; j++) f >> m(i, j); in[name] = m; } }
  bool looped = atoi(argv[4]);
  NnetSimpleComputationOptions opts;
  opts.frames_per_chunk = atoi(argv[5]);
  opts.extra_left_context = atoi(argv[6]);
  opts.extra_right_context = atoi(argv[7]);
  opts.extra_left_context_initial = atoi(argv[8]);
  opts.extra_right_context_final = atoi(argv[9]);
  opts.frame_subsampling_factor = atoi(argv[10]);
  opts.acoustic_scale = 1.0;
  int period = atoi(argv[11]);
  SetBatchnormTestMode(true, &nnet);
  SetDropoutTestMode(true, &nnet);
  CollapseModel(CollapseModelConfig(), &nnet);
  Vector<BaseFloat> priors;
  const Matrix<BaseFloat> &feats = in["features"];
  Vector<BaseFloat> iv; const VectorBase<BaseFloat> *ivp = NULL;
  if (in.count("ivector")) { iv.Resize(in["ivector"].NumCols()); iv.CopyRowFromMat(in["ivector"], 0); ivp = &iv; }
  const Matrix<BaseFloat> *online = in.count("online") ? &in["online"] : NULL;
  Matrix<BaseFloat> out;
  if (!looped) {
    CachingOptimizingCompiler compiler(nnet, opts.optimize_config);
    DecodableNnetSimple d(opts, nnet, priors, feats, &compiler, ivp, online, period);
    out.Resize(d.NumFrames(), d.OutputDim());
    for (int t = 0; t < d.NumFrames(); t++) { SubVector<BaseFloat> row(out, t); d.GetOutputForFrame(t, &row); }
  } else {
    NnetSimpleLoopedComputationOptions lo;
    lo.extra_left_context_initial = std::max(0, opts.extra_left_context_initial);
    lo.frame_subsampling_factor = opts.frame_subsampling_factor;
    lo.frames_per_chunk = opts.frames_per_chunk;
    lo.acoustic_scale = 1.0;
    if (argc > 12)
      RandomOptimizeOptions((unsigned)atoi(argv[12]), ComputationRequest(),
                            std::string(argv[3]) + ".options.json", &lo.optimize_config, false);
    DecodableNnetSimpleLoopedInfo info(lo, &nnet);
    DecodableNnetSimpleLooped d(info, feats, ivp, online, period);
    out.Resize(d.NumFrames(), d.OutputDim());
    for (int t = 0; t < d.NumFrames(); t++) { SubVector<BaseFloat> row(out, t); d.GetOutputForFrame(t, &row); }
  }
  std::ofstream of(argv[3]);
  WriteMat(of, "output", out);
  return 0;
}
