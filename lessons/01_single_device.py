"""Lesson 1: one device. An autograd engine, an MLP in one flat buffer, and a training loop, on real digits.

Everything distributed training does happens around this loop, so we look at it closely first:

    python lessons/01_single_device.py                  # or: dtrain launch -n 1 lessons/01_single_device.py
    python lessons/01_single_device.py --epochs 30 --plot digits.png
`--device gpu` runs the same on a GPU (one rank, so GPU 0); section 1's five numbers stay on the CPU.

What you will see:
  1. autograd on a three-line function, checked against finite differences;
  2. the model's parameters living in ONE contiguous buffer (what collectives will send);
  3. the training loop written out, training on the 8x8 handwritten digits to ~98% test accuracy;
  4. the same run through dtrain's driver, which writes metrics.json and ends with bit-identical weights.

Things to try:
  * in section 3, lr=0.5 instead of 0.05: the loss jumps, then sits at ln 10 = 2.30 (a blind guess among 10
    classes) and the accuracy falls to chance; in a terminal, `dtrain train --lr 1e6` shows how the driver stops a
    run whose loss becomes NaN;
  * `dtrain train --optimizer adam --lr 1e-3`, or `--hidden none` (no hidden layer: a linear model, ~97% here,
    because the digits are nearly linearly separable), or `--hidden 512,512`;
  * `dtrain train --dataset spirals --samples 3000 --classes 3 --epochs 30 --hidden none` (~54%: three interleaved
    spirals, no straight line separates them) against the same with the default hidden layers (~99%);
  * `dtrain train --dtype float64`: about the same accuracy, but other weights (the rounding differs);
  * `--seed 1`: another initialisation and another shuffle, so another weights_sha256 in metrics.json.

Exercises (`dtrain exercises init ex` once, then `dtrain exercises check 1.1 --path ex`; one process, no ranks):
  1.1  ex/backward.py: matmul_backward(grad, a, b) -> (grad_a, grad_b), the backward rule of C = A @ B that
       autograd.py's matmul uses; checked against finite differences, on shapes down to a single row or column.
  1.2  ex/backward.py: linear_backward(grad_out, x, weight) -> (grad_x, grad_weight, grad_bias), a Linear layer's
       rule; checked against finite differences and against the autograd engine's gradients of nn.Linear.
"""

import argparse
import tempfile

import numpy as np
from lesson_util import add_device_flag, heading, lesson_xp, refuse, say

from dtrain import terminal
from dtrain.autograd import Tensor, softmax_cross_entropy
from dtrain.backend import weights_digest
from dtrain.comm import mpi
from dtrain.config import TrainConfig
from dtrain.data import ShardedLoader, load_dataset
from dtrain.errors import MissingPackage
from dtrain.nn import MLP
from dtrain.optim import SGD
from dtrain.report import load_metrics, plot_metrics, pyplot
from dtrain.train import evaluate, train

parser = argparse.ArgumentParser(description="Lesson 1: single-device training")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--plot", metavar="PNG", help="save the loss/accuracy curves here")
add_device_flag(parser)
args = parser.parse_args()

if mpi.size() > 1:
    refuse("lesson 1 is about one device: run it with python, or dtrain launch -n 1")
if args.plot:
    try:
        pyplot()  # now, not after training: a missing matplotlib is one line before anything runs
    except MissingPackage as exc:
        refuse(f"--plot: {exc}")
xp = lesson_xp(args, mpi.world())  # numpy, or cupy (--device gpu; no GPU here: one line, and exit status 2)
say("Lesson 1: one device. An autograd engine, an MLP in one flat buffer, and a training loop, on real digits.", "",
    "   ")  # fmt: skip

# ---------------------------------------------------------------------------------------------- 1. autograd
heading("1. Autograd: y = sum(relu(w * x + b)), gradients by the chain rule vs by finite differences")
if args.device == "gpu":
    say("(--device gpu: these five numbers stay on the CPU; sections 2-4 run on the GPU)")
rng = np.random.default_rng(0)
x = Tensor(rng.normal(size=5))
w = Tensor(rng.normal(size=5), requires_grad=True)
b = Tensor(np.array(0.3), requires_grad=True)
y = (w * x + b).relu().sum()
y.backward()  # walks the graph once, from y back to w and b


def f(w_values):  # the same function on plain arrays, to differentiate numerically
    return np.maximum(w_values * x.data + b.data, 0).sum()


h = 1e-6
numeric = np.array([(f(w.data + h * e) - f(w.data - h * e)) / (2 * h) for e in np.eye(5)])
gradients = {"autograd": w.grad, "finite differences": numeric}
rows = [[how, *(f"{v:.6f}" for v in values)] for how, values in gradients.items()]
print(terminal.table(["dy/dw by", *(f"w[{i}]" for i in range(5))], rows, indent="   "))
assert np.allclose(w.grad, numeric, atol=1e-5)

# ----------------------------------------------------------------------------------------- 2. flat buffers
data = load_dataset("digits")
model = MLP([data.n_features, 128, 128, data.n_classes], seed=0, xp=xp)
heading(f"2. The model: {model}")
say(f"{model.num_parameters():,} parameters, all in one buffer of {model.flat_params.nbytes:,} bytes:")
for name, where in model.param_slices.items():
    print(f"     {name:18s} flat_params[{where.start:6d}:{where.stop:6d}]")
first = model.layers[0].weight
shares = xp.shares_memory(first.data, model.flat_params)
say(f"layers.0.weight is a view: shares memory with flat_params -> {shares}")

# -------------------------------------------------------------------------------------- 3. the training loop
heading("3. Training on digits: " + ", ".join(f"{key}={value}" for key, value in data.describe().items()))
optimizer = SGD(model, lr=0.05, momentum=0.9)
loader = ShardedLoader(data.x_train, data.y_train, global_batch=64, seed=0, xp=xp)  # one rank: the whole batch
for epoch in range(1, args.epochs + 1):
    losses = []
    for xb, yb in loader.epoch(epoch):
        model.zero_grad()  # one memset of flat_grads
        loss = softmax_cross_entropy(model(Tensor(xb)), yb)
        loss.backward()  # gradients land in flat_grads
        optimizer.step()  # a few vector operations on flat_params
        losses.append(float(loss.data))
    test_loss, test_acc = evaluate(model, data, xp)
    print(f"   epoch {epoch:2d}  train loss {np.mean(losses):.4f}  test accuracy {100 * test_acc:.2f}%")

# -------------------------------------------------------------------------------------------- 4. the driver
heading("4. The same through the driver (what `dtrain train` runs), which writes metrics.json:")
with tempfile.TemporaryDirectory() as out:
    train(TrainConfig(epochs=args.epochs, out=out, progress=False, quiet=True, device=args.device))
    metrics = load_metrics(out)
    final = metrics["final"]["test_accuracy"]
    say(f"final test accuracy {100 * final:.2f}%, {metrics['samples_per_s']:,.0f} samples/s")
    say(f"weights sha256 {metrics['weights_sha256'][:16]}...")
    # Same data, seed, model, optimizer and batches as section 3: the driver *is* that loop, to the last bit.
    same = metrics["weights_sha256"] == weights_digest(model.flat_params)
    print(f"   bit-identical to the weights of the loop in section 3: {'yes' if same else 'NO'}")
    assert same
    if args.plot:
        say(f"curves saved to {plot_metrics([out], args.plot, labels=['single device'])}")
print()
print(terminal.paragraph("Next: lesson 2 runs the same arithmetic on several ranks, starting with the all-reduce."))
print()
print(terminal.paragraph(
    "Exercises: write the backward rules yourself. `dtrain exercises init ex` once, then each of these commands"
    " grades one, in ex/backward.py, against finite differences (and 1.2 against autograd too):"
))  # fmt: skip
for command, what in (("1.1", "matmul_backward(grad, a, b), for C = A @ B"),
                      ("1.2", "linear_backward(grad_out, x, weight), for y = x @ W + b")):  # fmt: skip
    print(f"  dtrain exercises check {command} --path ex")
    print(terminal.paragraph(what, "      "))
