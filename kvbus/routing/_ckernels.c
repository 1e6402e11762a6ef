/* kvbus.routing._ckernels: the per-item loops of PrefixIndex, in C.
 *
 * The same functions as kvbus/routing/_kernels.py (the reference, and the fallback where this
 * does not build). The index's have the same results on the index's own Python dicts
 * and ints, so queries, introspection and the pure-Python index read them unchanged;
 * tests/test_index_kernels.py checks the two against each other. What moves here is
 * only what runs once per block (a bytes conversion, a chained hash, three dict
 * updates); everything decided once per event stays in Python.
 *
 * The subscriber has no C: every parse of an envelope from network bytes is msgspec's
 * (BENCHMARKS.md, "Issue 30: the subscriber's C path": it ran only for consumers that
 * read no payload).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* An int below 2**30 read in place, or -1 for anything else (which takes the general
 * way: a call per item, 3x slower over a 512-token event). */
static inline Py_ssize_t
small_int(PyObject *item)
{
    if (!PyLong_CheckExact(item))
        return -1;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item))
        return -1;
    return PyUnstable_Long_CompactValue((PyLongObject *)item); /* < 0 for a negative */
#else
    switch (Py_SIZE(item)) {
    case 0:
        return 0;
    case 1:
        return (Py_ssize_t)((PyLongObject *)item)->ob_digit[0];
    default:
        return -1;
    }
#endif
}

/* token_bytes(token_ids) -> bytes: the ids as native uint32, as array("I", ids).tobytes(). */
static PyObject *
token_bytes(PyObject *module, PyObject *token_ids)
{
    PyObject *seq = PySequence_Fast(token_ids, "token ids must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n > PY_SSIZE_T_MAX / 4) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    char *dest = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long value;
        Py_ssize_t small = small_int(items[i]);
        if (small >= 0) {
            value = (unsigned long)small;
        }
        else {
            PyObject *index = PyNumber_Index(items[i]); /* TypeError when not an integer */
            if (index == NULL)
                goto fail;
            value = PyLong_AsUnsignedLong(index); /* OverflowError when negative */
            Py_DECREF(index);
            if (value == (unsigned long)-1 && PyErr_Occurred())
                goto fail;
            if (value > UINT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "token id does not fit in 32 bits");
                goto fail;
            }
        }
        uint32_t word = (uint32_t)value;
        memcpy(dest + 4 * i, &word, 4);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* Big-endian unsigned integer of ``size`` bytes at ``at``. */
static inline uint64_t
read_be(const unsigned char *at, int size)
{
    uint64_t value = 0;
    for (int i = 0; i < size; i++)
        value = (value << 8) | at[i];
    return value;
}

/* Per msgpack tag of an unsigned int up to 32 bits: its bytes, tag included (0: any
 * other tag), and how to cut its value out of the 5 bytes from the tag on. */
static unsigned char ITEM_BYTES[256], ITEM_SHIFT[256];
static uint64_t ITEM_MASK[256];

static void
fill_item_tables(void)
{
    for (int tag = 0; tag <= 0x7f; tag++) { /* positive fixint: the tag is the value */
        ITEM_BYTES[tag] = 1;
        ITEM_SHIFT[tag] = 32;
        ITEM_MASK[tag] = 0x7f;
    }
    const int tags[3] = {0xcc, 0xcd, 0xce}, sizes[3] = {1, 2, 4}; /* uint8/16/32 */
    for (int i = 0; i < 3; i++) {
        ITEM_BYTES[tags[i]] = (unsigned char)(1 + sizes[i]);
        ITEM_SHIFT[tags[i]] = (unsigned char)(8 * (4 - sizes[i]));
        ITEM_MASK[tags[i]] = (UINT64_C(1) << (8 * sizes[i])) - 1;
    }
}

/* packed_token_bytes(packed) -> bytes: a msgpack array of ints (an event's token ids
 * as sent, left undecoded: msgspec.Raw) as native uint32, without an int object per
 * token. The same result and errors as the reference: ValueError when ``packed`` is
 * not exactly one array of ints (in any of msgpack's int encodings), else
 * OverflowError when an id is below 0 or past 32 bits. A forged count costs nothing:
 * it must fit in the bytes given before anything is allocated. */
static PyObject *
packed_token_bytes(PyObject *module, PyObject *packed)
{
    Py_buffer view;
    if (PyObject_GetBuffer(packed, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *at = view.buf, *end = at + view.len;
    PyObject *out = NULL;
    uint64_t count = 0;
    int header = 0, overflow = 0; /* raised after the whole array is read: a ValueError wins */
    if (at < end && (*at & 0xf0) == 0x90) {
        count = *at & 0x0f;
    }
    else if (at < end && (*at == 0xdc || *at == 0xdd)) {
        header = *at == 0xdc ? 2 : 4;
        if (end - at < 1 + header)
            goto malformed;
        count = read_be(at + 1, header);
    }
    else {
        goto malformed;
    }
    at += 1 + header;
    if (count > (uint64_t)(end - at)) /* every id takes at least one byte */
        goto malformed;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)count * 4);
    if (out == NULL)
        goto done;
    char *dest = PyBytes_AS_STRING(out);
    for (uint64_t i = 0; i < count; i++) {
        if (at == end)
            goto malformed;
        unsigned char tag = *at;
        if (ITEM_BYTES[tag] && end - at >= 5) {
            /* fixint, uint8, uint16, uint32 (the ids of a 128k vocabulary, in no order a
             * branch predictor guesses): one 5-byte read, shifted and masked per tag. */
            uint64_t item = read_be(at, 5);
            uint32_t word = (uint32_t)((item >> ITEM_SHIFT[tag]) & ITEM_MASK[tag]);
            memcpy(dest + 4 * i, &word, 4);
            at += ITEM_BYTES[tag];
            continue;
        }
        at++;
        uint64_t value;
        if (tag <= 0x7f) {
            value = tag;
        }
        else if (tag >= 0xe0) { /* a negative fixint */
            overflow = 1;
            value = 0;
        }
        else if (tag >= 0xcc && tag <= 0xd3) {
            int size = 1 << ((tag - 0xcc) & 3); /* uint8..uint64, then int8..int64 */
            if (end - at < size)
                goto malformed;
            value = read_be(at, size);
            at += size;
            if (tag >= 0xd0 && (value >> (8 * size - 1)) & 1) /* a negative int */
                overflow = 1;
            else if (value > UINT32_MAX)
                overflow = 1;
        }
        else {
            goto malformed;
        }
        uint32_t word = (uint32_t)value;
        memcpy(dest + 4 * i, &word, 4);
    }
    if (at != end)
        goto malformed;
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "token id does not fit in 32 bits");
        Py_CLEAR(out);
    }
    goto done;
malformed:
    Py_CLEAR(out);
    PyErr_SetString(PyExc_ValueError, "token ids: not a msgpack array of ints");
done:
    PyBuffer_Release(&view);
    return out;
}

/* Router keys: BLAKE2b (RFC 7693) with an 8-byte digest, no key, personalization
 * KEY_PERSON, over (the parent key as 8 little-endian bytes, the block's bytes): the
 * same keys in every process, as replicas share them (_kernels.block_key, whose
 * hashlib is the reference; tests/test_index_kernels.py compares the two). Only what
 * one chained key needs: the parameter block is folded into KEY_IV once at import. */
static const uint64_t BLAKE2B_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};
static const unsigned char BLAKE2B_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};
static const char KEY_PERSON[16] = "kvbus.key.v1"; /* zero-padded, as hashlib pads it */
static uint64_t KEY_IV[8];                         /* BLAKE2B_IV ^ the parameter block */

static inline uint64_t
load64(const unsigned char *p)
{
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--)
        x = (x << 8) | p[i];
    return x;
}

static inline uint64_t
rotr64(uint64_t x, int n)
{
    return (x >> n) | (x << (64 - n));
}

static void
key_iv_init(void)
{
    memcpy(KEY_IV, BLAKE2B_IV, sizeof KEY_IV);
    KEY_IV[0] ^= 0x01010000u | 8u; /* fanout 1, depth 1, no key, an 8-byte digest */
    KEY_IV[6] ^= load64((const unsigned char *)KEY_PERSON);
    KEY_IV[7] ^= load64((const unsigned char *)KEY_PERSON + 8);
}

#define BLAKE2B_G(a, b, c, d, x, y)                                                        \
    do {                                                                                   \
        v[a] = v[a] + v[b] + (x);                                                          \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                    \
        v[c] = v[c] + v[d];                                                                \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                    \
        v[a] = v[a] + v[b] + (y);                                                          \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                    \
        v[c] = v[c] + v[d];                                                                \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                    \
    } while (0)

#define BLAKE2B_ROUND(r)                                                                   \
    do {                                                                                   \
        BLAKE2B_G(0, 4, 8, 12, m[BLAKE2B_SIGMA[r][0]], m[BLAKE2B_SIGMA[r][1]]);            \
        BLAKE2B_G(1, 5, 9, 13, m[BLAKE2B_SIGMA[r][2]], m[BLAKE2B_SIGMA[r][3]]);            \
        BLAKE2B_G(2, 6, 10, 14, m[BLAKE2B_SIGMA[r][4]], m[BLAKE2B_SIGMA[r][5]]);           \
        BLAKE2B_G(3, 7, 11, 15, m[BLAKE2B_SIGMA[r][6]], m[BLAKE2B_SIGMA[r][7]]);           \
        BLAKE2B_G(0, 5, 10, 15, m[BLAKE2B_SIGMA[r][8]], m[BLAKE2B_SIGMA[r][9]]);           \
        BLAKE2B_G(1, 6, 11, 12, m[BLAKE2B_SIGMA[r][10]], m[BLAKE2B_SIGMA[r][11]]);         \
        BLAKE2B_G(2, 7, 8, 13, m[BLAKE2B_SIGMA[r][12]], m[BLAKE2B_SIGMA[r][13]]);          \
        BLAKE2B_G(3, 4, 9, 14, m[BLAKE2B_SIGMA[r][14]], m[BLAKE2B_SIGMA[r][15]]);          \
    } while (0)

/* One 128-byte block into h; ``counted``: message bytes so far, this block's included. */
static void
blake2b_compress(uint64_t h[8], const unsigned char block[128], uint64_t counted, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++)
        m[i] = load64(block + 8 * i);
    memcpy(v, h, 8 * sizeof *v);
    memcpy(v + 8, BLAKE2B_IV, 8 * sizeof *v);
    v[12] ^= counted; /* the counter's high word stays 0: a key hashes < 2**64 bytes */
    if (last)
        v[14] = ~v[14];
    /* Unrolled, so that every message word's index is a constant (2x quicker). */
    BLAKE2B_ROUND(0);
    BLAKE2B_ROUND(1);
    BLAKE2B_ROUND(2);
    BLAKE2B_ROUND(3);
    BLAKE2B_ROUND(4);
    BLAKE2B_ROUND(5);
    BLAKE2B_ROUND(6);
    BLAKE2B_ROUND(7);
    BLAKE2B_ROUND(8);
    BLAKE2B_ROUND(9);
    BLAKE2B_ROUND(10);
    BLAKE2B_ROUND(11);
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* The key of ``block`` (``size`` bytes) under ``parent``: _kernels.block_key. */
static int64_t
block_key(int64_t parent, const unsigned char *block, Py_ssize_t size)
{
    uint64_t h[8];
    unsigned char buffer[128];
    memcpy(h, KEY_IV, sizeof h);
    uint64_t word = (uint64_t)parent; /* two's complement, written little-endian */
    for (int i = 0; i < 8; i++, word >>= 8)
        buffer[i] = (unsigned char)word;
    size_t filled = 8, left = (size_t)size;
    uint64_t counted = 8;
    /* Compress a full buffer only once more bytes follow: the last block is final. */
    while (left > 0) {
        if (filled == sizeof buffer) {
            blake2b_compress(h, buffer, counted, 0);
            filled = 0;
        }
        size_t take = sizeof buffer - filled < left ? sizeof buffer - filled : left;
        memcpy(buffer + filled, block, take);
        filled += take;
        block += take;
        left -= take;
        counted += take;
    }
    memset(buffer + filled, 0, sizeof buffer - filled);
    blake2b_compress(h, buffer, counted, 1);
    /* The digest's 8 bytes (h[0], little-endian), read as a signed int: two's
     * complement, copied rather than converted (which C leaves to the compiler). */
    int64_t key;
    memcpy(&key, &h[0], sizeof key);
    return key;
}

/* chain(data, step, parent) -> list[int]: block_key(the key before, block) for each
 * full ``step``-byte block of ``data``, the first chained from ``parent``. */
static PyObject *
chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain(data, step, parent) takes 3 arguments");
        return NULL;
    }
    PyObject *data = args[0];
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "chain: data must be bytes");
        return NULL;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    if (step <= 0) {
        PyErr_SetString(PyExc_ValueError, "chain: step must be positive");
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "chain: parent must be an int");
        return NULL;
    }
    long long parent = PyLong_AsLongLong(args[2]); /* OverflowError past 64 signed bits */
    if (parent == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t count = PyBytes_GET_SIZE(data) / step;
    const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(data);
    PyObject *keys = PyList_New(count);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        parent = block_key(parent, bytes + i * step, step);
        PyObject *key = PyLong_FromLongLong(parent);
        if (key == NULL) {
            /* PyList_New's unset slots are NULL, which the list's dealloc skips. */
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, key);
    }
    return keys;
}

/* mask | bit into masks[key] (a missing mask is 0). */
static int
add_holder(PyObject *masks, PyObject *key, PyObject *bit)
{
    PyObject *old = PyDict_GetItemWithError(masks, key);
    if (old == NULL) {
        if (PyErr_Occurred())
            return -1;
        return PyDict_SetItem(masks, key, bit);
    }
    PyObject *mask = PyNumber_Or(old, bit);
    if (mask == NULL)
        return -1;
    int result = PyDict_SetItem(masks, key, mask);
    Py_DECREF(mask);
    return result;
}

/* masks[key] &= clear; a mask left empty goes (a missing one stays missing). */
static int
remove_holder(PyObject *masks, PyObject *key, PyObject *clear)
{
    PyObject *old = PyDict_GetItemWithError(masks, key);
    if (old == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *mask = PyNumber_And(old, clear);
    if (mask == NULL)
        return -1;
    int empty = !PyObject_IsTrue(mask);
    int result = empty ? PyDict_DelItem(masks, key) : PyDict_SetItem(masks, key, mask);
    Py_DECREF(mask);
    return result;
}

static int
check_dicts(PyObject *const *args, Py_ssize_t count, const char *name)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyDict_CheckExact(args[i])) {
            PyErr_Format(PyExc_TypeError, "%s: argument %zd must be a dict", name, i + 1);
            return -1;
        }
    }
    return 0;
}

/* store_new(known, held, masks, hashes, keys, bit, unit) -> bool
 *
 * known[hashes[i]] = keys[i] for every key (``keys`` is no longer than ``hashes``).
 * Then, when every key is distinct and not in ``held`` (an event's blocks are nearly
 * always new to the worker): held[key] = unit and masks[key] |= bit for each, and
 * True. Otherwise False, ``held`` and ``masks`` untouched (the caller counts copies
 * block by block). */
static PyObject *
store_new(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "store_new takes 7 arguments");
        return NULL;
    }
    if (check_dicts(args, 3, "store_new") < 0)
        return NULL;
    PyObject *known = args[0], *held = args[1], *masks = args[2];
    PyObject *bit = args[5], *unit = args[6];
    PyObject *hashes = PySequence_Fast(args[3], "store_new: hashes must be a sequence");
    if (hashes == NULL)
        return NULL;
    PyObject *keys = PySequence_Fast(args[4], "store_new: keys must be a sequence");
    if (keys == NULL) {
        Py_DECREF(hashes);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **key = PySequence_Fast_ITEMS(keys);
    PyObject **hash = PySequence_Fast_ITEMS(hashes);
    if (n > PySequence_Fast_GET_SIZE(hashes)) {
        PyErr_SetString(PyExc_ValueError, "store_new: more keys than hashes");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyDict_SetItem(known, hash[i], key[i]) < 0)
            goto done;
    }
    /* One lookup per block: held grows by one per new key; a key already there (or
     * repeated in this event) does not grow it, and the keys added before it go. */
    Py_ssize_t size = PyDict_GET_SIZE(held);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyDict_SetDefault(held, key[i], unit) == NULL)
            goto done;
        if (PyDict_GET_SIZE(held) == size) {
            for (Py_ssize_t j = 0; j < i; j++) {
                if (PyDict_DelItem(held, key[j]) < 0)
                    goto done;
            }
            result = Py_NewRef(Py_False);
            goto done;
        }
        size++;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (add_holder(masks, key[i], bit) < 0)
            goto done;
    }
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(hashes);
    Py_DECREF(keys);
    return result;
}

/* drop_only_copies(known, held, masks, hashes, bit, unit) -> bool
 *
 * When every hash is known, distinct, and its block's count is exactly ``unit`` (the
 * worker's only copy, in that medium: the usual eviction): the blocks leave ``held``,
 * the worker's bit leaves their masks, and True. Otherwise False, nothing changed. */
static PyObject *
drop_only_copies(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "drop_only_copies takes 6 arguments");
        return NULL;
    }
    if (check_dicts(args, 3, "drop_only_copies") < 0)
        return NULL;
    PyObject *known = args[0], *held = args[1], *masks = args[2];
    PyObject *bit = args[4], *unit = args[5];
    PyObject *hashes = PySequence_Fast(args[3], "drop_only_copies: hashes must be a sequence");
    if (hashes == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **hash = PySequence_Fast_ITEMS(hashes);
    PyObject *result = NULL, *clear = NULL;
    /* Borrowed from ``known`` (left unchanged here), so they outlive held's copies. */
    PyObject **keys = PyMem_New(PyObject *, n > 0 ? n : 1);
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        keys[i] = PyDict_GetItemWithError(known, hash[i]);
        if (keys[i] == NULL) {
            if (!PyErr_Occurred())
                result = Py_NewRef(Py_False);
            goto done;
        }
        PyObject *count = PyDict_GetItemWithError(held, keys[i]);
        if (count == NULL) {
            if (!PyErr_Occurred())
                result = Py_NewRef(Py_False);
            goto done;
        }
        int only = PyObject_RichCompareBool(count, unit, Py_EQ);
        if (only <= 0) {
            if (only == 0)
                result = Py_NewRef(Py_False);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyDict_DelItem(held, keys[i]) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError))
                goto done;
            /* keys[i] repeats an earlier block of this event: put them back. */
            PyErr_Clear();
            for (Py_ssize_t j = 0; j < i; j++) {
                if (PyDict_SetItem(held, keys[j], unit) < 0)
                    goto done;
            }
            result = Py_NewRef(Py_False);
            goto done;
        }
    }
    clear = PyNumber_Invert(bit);
    if (clear == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (remove_holder(masks, keys[i], clear) < 0)
            goto done;
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(keys);
    Py_XDECREF(clear);
    Py_DECREF(hashes);
    return result;
}

static PyMethodDef methods[] = {
    {"token_bytes", (PyCFunction)token_bytes, METH_O, NULL},
    {"packed_token_bytes", (PyCFunction)packed_token_bytes, METH_O, NULL},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, NULL},
    {"store_new", (PyCFunction)(void (*)(void))store_new, METH_FASTCALL, NULL},
    {"drop_only_copies", (PyCFunction)(void (*)(void))drop_only_copies, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvbus.routing._ckernels",
    .m_doc = "Per-item loops of the index (kvbus/routing/_kernels.py: the reference).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__ckernels(void)
{
    fill_item_tables(); /* constants: the same on every call */
    key_iv_init();
    return PyModuleDef_Init(&module);
}
