"""The operators' schemas (torch.library), with torch references as their implementation for every device;
the compiled CPU kernels (csrc/) register for the CPU key and take over there."""
from __future__ import annotations

import torch

from kvforge.ops import greedy, layers_reference, qblocks, reference

assert qblocks.LIB and greedy.LIB  # they define qblock_linear, qblock_panel_linear and argmax_rows

LIB = torch.library.Library("kvforge", "FRAGMENT")
LIB.define("paged_decode(Tensor q, Tensor block_table, Tensor context_lens, float scale, int window, "
           "int[] k_meta, Tensor[] k_parts, int[] v_meta, Tensor[] v_parts, Tensor[] stage, Tensor[] sink) -> Tensor")
LIB.impl("paged_decode", reference.paged_decode, "CompositeExplicitAutograd")
LIB.define("paged_attend(Tensor q, Tensor query_start, Tensor block_table, Tensor context_lens, float scale, int window, "
           "int[] k_meta, Tensor[] k_parts, int[] v_meta, Tensor[] v_parts, Tensor[] stage, Tensor[] sink) -> Tensor")
LIB.impl("paged_attend", reference.paged_attend, "CompositeExplicitAutograd")
LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
LIB.impl("rms_norm", layers_reference.rms_norm, "CompositeExplicitAutograd")
LIB.define("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor")
LIB.impl("add_rms_norm_", layers_reference.add_rms_norm_, "CompositeExplicitAutograd")
LIB.define("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()")
LIB.impl("rope_", layers_reference.rope_, "CompositeExplicitAutograd")
LIB.define("silu_mul(Tensor gate_up) -> Tensor")
LIB.impl("silu_mul", layers_reference.silu_mul, "CompositeExplicitAutograd")
LIB.define("gelu_tanh_mul(Tensor gate_up) -> Tensor")
LIB.impl("gelu_tanh_mul", layers_reference.gelu_tanh_mul, "CompositeExplicitAutograd")
LIB.define("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
LIB.impl("small_linear", layers_reference.linear, "CompositeExplicitAutograd")
LIB.define("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor")
LIB.impl("panel_linear", layers_reference.panel_linear, "CompositeExplicitAutograd")
LIB.define("int8_panel_linear(Tensor x, Tensor panels, Tensor scale, int n, Tensor? bias) -> Tensor")
LIB.impl("int8_panel_linear", layers_reference.int8_panel_linear, "CompositeExplicitAutograd")
LIB.define("layer_bridge(Tensor? attn, Tensor(a!) residual, Tensor cos, Tensor sin, Tensor[] post, Tensor[] pre, "
           "int heads, int kv_heads, float eps, Tensor(b!)[] kv_write, Tensor[]? family_norms=None, "
           "str activation='silu') -> Tensor")
LIB.impl("layer_bridge", layers_reference.layer_bridge, "CompositeExplicitAutograd")
