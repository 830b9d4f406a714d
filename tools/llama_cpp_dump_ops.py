"""Record what llama.cpp computes inside one forward pass, op by op, for tests/test_ops_llama_exact.py.

Runs llama-cpp-python (run this script with the python that has it) with a ggml eval callback that copies
every float32 tensor the graph computes, for a prompt batch of the given tokens and then one decode step (the
two use different kernels in llama.cpp), and keeps the tensors the test needs: each op's input and output for
a few layers, so each of our ops can be checked on llama.cpp's own inputs, bit for bit.

    /path/to/llama-venv/bin/python tools/llama_cpp_dump_ops.py MODEL.gguf OUT.npz --tokens 1,2,3,... \\
        --layers 0,5 --keep Qcur,Kcur,... --rows 4 --row-limited ffn_gate,ffn_up

Keys in OUT.npz: "<tensor name>@<layer>/<pass>" with pass "batch" or "step" (e.g. "Qcur@0/batch#2" is the
third tensor named Qcur-0 in the batch pass, llama.cpp names some tensors more than once), arrays shaped as
ggml's [ne2, ne1, ne0]: [1, tokens, n] for activations, [tokens, heads, head_dim] per head, [heads, tokens,
keys] for attention's products; "tokens" holds the token ids (the last one is the decode step).
"""
import argparse
import ctypes

import numpy as np

# The ggml_tensor layout of the ggml that llama-cpp-python 0.3.x bundles (ggml.h: GGML_MAX_DIMS 4,
# GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64).


class GGMLTensor(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


GGML_TYPE_F32 = 0


def capture(llama_cpp, model_path, batches, n_ctx=256):
    """Evaluate the token batches in order; returns one {name: [arrays in graph order]} per batch."""
    passes = []

    @llama_cpp.ggml_backend_sched_eval_callback
    def callback(tensor, ask, _user_data):
        if ask:
            return True
        t = ctypes.cast(tensor, ctypes.POINTER(GGMLTensor)).contents
        ne, nb = list(t.ne), list(t.nb)
        contiguous = nb[0] == 4 and nb[1] == 4 * ne[0] and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2]
        if t.type == GGML_TYPE_F32 and contiguous:
            n = ne[0] * ne[1] * ne[2] * ne[3]
            values = np.ctypeslib.as_array((ctypes.c_float * n).from_address(t.data)).copy()
            passes[-1].setdefault(t.name.decode(), []).append(values.reshape(ne[3], ne[2], ne[1], ne[0]))
        return True

    default_params = llama_cpp.llama_context_default_params

    def with_callback():
        params = default_params()
        params.cb_eval = callback
        return params

    llama_cpp.llama_context_default_params = with_callback
    llama_cpp.llama.llama_cpp.llama_context_default_params = with_callback
    try:
        llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False)
        for batch in batches:
            passes.append({})
            llm.eval(batch)
        del llm
    finally:
        llama_cpp.llama_context_default_params = default_params
        llama_cpp.llama.llama_cpp.llama_context_default_params = default_params
    return passes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tokens", required=True, help="comma-separated ids; all but the last form the batch")
    ap.add_argument("--layers", default="0")
    ap.add_argument("--keep", default="", help="comma-separated tensor names to keep (default: all of the layers')")
    ap.add_argument("--rows", type=int, default=0, help="keep at most this many token rows (0: all)")
    ap.add_argument("--row-limited", default="", help="comma-separated tensor names --rows applies to")
    args = ap.parse_args()
    import llama_cpp
    tokens = [int(t) for t in args.tokens.split(",")]
    layers = [int(x) for x in args.layers.split(",")]
    keep = set(filter(None, args.keep.split(",")))
    row_limited = set(filter(None, args.row_limited.split(",")))
    out = {"tokens": np.array(tokens, np.int32)}
    for label, captured in zip(("batch", "step"), capture(llama_cpp, args.model, [tokens[:-1], tokens[-1:]])):
        for name, arrays in captured.items():
            base, _, layer = name.partition("-")
            if " " in name or (layer and (not layer.isdigit() or int(layer) not in layers)):
                continue
            if keep and base not in keep:
                continue
            for i, a in enumerate(arrays):
                key = f"{base}@{layer or '-'}/{label}#{i}"
                # ggml's [ne3, ne2, ne1, ne0] without ne3 (always 1 here): [1, tokens, n] for activations,
                # [tokens, heads, head_dim] per head, [heads, tokens, keys] for attention's products
                a = a[0]
                if args.rows and base in row_limited:
                    a = a[:, :args.rows] if a.shape[0] == 1 else a[:args.rows]
                out[key] = a
    np.savez_compressed(args.out, **out)
    print(f"{len(out) - 1} tensors -> {args.out}")


if __name__ == "__main__":
    main()
