# kvbus/routing/_ckernels.c: the same functions as kvbus/routing/_kernels.py (the reference).
from kvbus.routing._kernels import chain as chain
from kvbus.routing._kernels import drop_only_copies as drop_only_copies
from kvbus.routing._kernels import packed_token_bytes as packed_token_bytes
from kvbus.routing._kernels import store_new as store_new
from kvbus.routing._kernels import token_bytes as token_bytes
