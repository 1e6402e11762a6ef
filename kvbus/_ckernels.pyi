# kvbus/_ckernels.c: the same functions as kvbus/_kernels.py (the reference).
from kvbus._kernels import chain as chain
from kvbus._kernels import drop_only_copies as drop_only_copies
from kvbus._kernels import packed_token_bytes as packed_token_bytes
from kvbus._kernels import store_new as store_new
from kvbus._kernels import token_bytes as token_bytes
