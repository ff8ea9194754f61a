// A C++ predictor for a model that calls torch.ops.kt_regroup: it loads kt_regroup's
// compiled op library, then the model, with no Python anywhere.
//
//   predictor MODEL LIB.so SHAPE... [--calls N]   (SHAPE: BxW, one per forward argument)
//
// MODEL is an AOTInductor package (*.pt2, examples/deploy.py's default, loaded with
// torch::inductor::AOTIModelPackageLoader) or, the legacy path, a TorchScript file (*.pt,
// torch::jit::load). With --calls N it then times N more calls (after 10 warm-up calls)
// and prints "per call: T us (N calls)", the mean wall time of one forward with its
// inputs ready.
//
// Inputs are integer-valued float tensors (element i = i % 17 - 8), so the printed
// checksums (per output: sum of values weighted by i % 101 + 1) are exact and a Python
// run of the same model can check them (examples/deploy.py: example_inputs, checksums).
// Build: see CMakeLists.txt.

#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

torch::Tensor example_input(const std::string& shape) {
  const auto x = shape.find('x');
  const int64_t rows = std::stoll(shape.substr(0, x));
  const int64_t cols = std::stoll(shape.substr(x + 1));
  return (torch::arange(rows * cols, torch::kFloat32).fmod(17) - 8).reshape({rows, cols});
}

void flatten(const c10::IValue& value, std::vector<torch::Tensor>& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& v : value.toTupleRef().elements()) flatten(v, out);
  } else if (value.isList()) {
    for (const auto& v : value.toListRef()) flatten(v, out);
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) flatten(item.value(), out);
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  long calls = 0;
  if (argc >= 3 && std::string(argv[argc - 2]) == "--calls") {
    calls = std::stol(argv[argc - 1]);
    argc -= 2;
  }
  if (argc < 4 || calls < 0) {
    std::cerr << "usage: predictor MODEL.pt2|MODEL.pt LIB.so SHAPE... [--calls N] (e.g. 8x44 8x13)\n";
    return 2;
  }
  // The op library registers torch.ops.kt_regroup.* with the dispatcher when loaded; both
  // model formats call the ops through it.
  if (dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "cannot load " << argv[2] << ": " << dlerror() << "\n";
    return 1;
  }
  const std::string path = argv[1];
  std::vector<torch::Tensor> inputs;
  for (int i = 3; i < argc; ++i) inputs.push_back(example_input(argv[i]));

  // One forward of either format: the inputs in, the output tensors out.
  std::function<std::vector<torch::Tensor>()> forward;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> package;
  torch::jit::Module script;
  if (ends_with(path, ".pt2")) {
    package = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path);
    forward = [&] { return package->run(inputs); };
  } else {
    script = torch::jit::load(path);
    script.eval();
    const std::vector<c10::IValue> args(inputs.begin(), inputs.end());
    forward = [&script, args] {
      std::vector<torch::Tensor> out;
      flatten(script.forward(args), out);
      return out;
    };
  }

  torch::InferenceMode guard;
  const std::vector<torch::Tensor> outputs = forward();
  for (size_t j = 0; j < outputs.size(); ++j) {
    const torch::Tensor& out = outputs[j];
    const torch::Tensor weights = torch::arange(out.numel(), torch::kFloat64).fmod(101) + 1;
    const double checksum = (out.to(torch::kFloat64).flatten() * weights).sum().item<double>();
    std::printf("output %zu shape %s checksum %.0f\n", j, c10::str(out.sizes()).c_str(), checksum);
  }
  if (calls > 0) {
    for (int i = 0; i < 10; ++i) forward();
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < calls; ++i) forward();
    const std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - start;
    std::printf("per call: %.3f us (%ld calls)\n", spent.count() / calls, calls);
  }
  return 0;
}
