"""One eager layer of a preset at T (planned config), for ncu: warm-up call, then the measured call."""
import sys, torch
from moekit.kernels.base import DeviceInfo
from moekit.planning.plan import plan
from moekit.presets import preset_at
from moekit.synthetic import random_batch, random_layer
from moekit.app.bench import prepared_weights, whole_layer
preset, t = sys.argv[1], int(sys.argv[2])
dev = torch.device("cuda")
spec = preset_at(preset)
layer = random_layer(spec, seed=0, device=dev)
chosen = plan(spec, num_tokens=t, device=DeviceInfo.of(dev))
print(chosen.config, flush=True)
w = prepared_weights(chosen, layer, {})
x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=dev)
fn = whole_layer(chosen, layer, w, x, logits, check_values=False)
fn(); torch.cuda.synchronize()
fn(); torch.cuda.synchronize()
