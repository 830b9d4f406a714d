import gguf.constants as C
class F:
    def __init__(s, t): s.name=t.name; s.block_size, s.type_size = C.GGML_QUANT_SIZES[t]
def format_by_id(i):
    try: return F(C.GGMLQuantizationType(i))
    except ValueError: raise KeyError(i)
