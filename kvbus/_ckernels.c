/* kvbus._ckernels: the per-item loops of PrefixIndex and of the subscriber's check, in C.
 *
 * The same functions as kvbus/_kernels.py (the reference, and the fallback where this
 * does not build). The index's have the same results on the index's own Python dicts
 * and ints, so queries, introspection and the pure-Python index read them unchanged;
 * tests/test_index_kernels.py checks the two against each other. What moves here is
 * only what runs once per block (a bytes conversion, a chained hash, three dict
 * updates); everything decided once per event stays in Python.
 *
 * plain_kv_envelopes vouches for KV batches so that the subscriber need not have
 * msgspec walk each one: it never vouches for what msgspec would refuse
 * (tests/test_kv_check_kernel.py), and leaves to msgspec whatever it is unsure of.
 * kv_run then makes a run of one source's vouched batches into the subscriber's
 * messages, reading each envelope itself in the encodings kvbus writes; anything else
 * ends the run, and the subscriber's per-entry path decides, as it would have
 * (tests/test_subscribe_runs.py compares the two on streams of every kind).
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

/* Per msgpack tag: the bytes of a scalar whose size the tag alone gives, tag included
 * (nil, booleans, ints, floats); 0 for anything else. */
static unsigned char SCALAR_BYTES[256];

static void
fill_scalar_table(void)
{
    for (int tag = 0; tag <= 0x7f; tag++) /* positive fixint */
        SCALAR_BYTES[tag] = 1;
    for (int tag = 0xe0; tag <= 0xff; tag++) /* negative fixint */
        SCALAR_BYTES[tag] = 1;
    SCALAR_BYTES[0xc0] = SCALAR_BYTES[0xc2] = SCALAR_BYTES[0xc3] = 1; /* nil, false, true */
    SCALAR_BYTES[0xca] = 5; /* float32 */
    SCALAR_BYTES[0xcb] = 9; /* float64 */
    for (int tag = 0xcc; tag <= 0xd3; tag++) /* uint8..uint64, int8..int64 */
        SCALAR_BYTES[tag] = (unsigned char)(1 + (1 << ((tag - 0xcc) & 3)));
}

#define PLAIN_MAX_DEPTH 32 /* nesting inside one event; vLLM's events nest 2 deep */

/* A walk over msgpack values that are plain: scalars, str, bin, and arrays and maps of
 * them nested at most PLAIN_MAX_DEPTH. Anything else (ext types, the reserved tag,
 * truncated data, deeper nesting) is not plain. Every value takes at least one byte, so
 * a forged count or length fails against ``end`` before it costs anything: a walk is
 * O(end - at), with no recursion. */
typedef struct {
    const unsigned char *at, *end;
    uint64_t left[PLAIN_MAX_DEPTH + 1]; /* values still to skip at each open level */
    int depth;
} Walk;

static inline void
walk_start(Walk *walk, const unsigned char *at, const unsigned char *end, uint64_t count)
{
    walk->at = at;
    walk->end = end;
    walk->left[0] = count;
    walk->depth = 0;
}

/* Past one more value: 1 while values are left, 0 when the walk is done, -1 where a
 * value is not plain. */
static inline int
walk_step(Walk *walk)
{
    while (walk->left[walk->depth] == 0) {
        if (walk->depth == 0)
            return 0;
        walk->depth--;
    }
    walk->left[walk->depth]--;
    const unsigned char *at = walk->at, *end = walk->end;
    if (at >= end)
        return -1;
    unsigned char tag = *at;
    if (SCALAR_BYTES[tag]) { /* the token ids: most of what there is */
        if (end - at < SCALAR_BYTES[tag])
            return -1;
        walk->at = at + SCALAR_BYTES[tag];
        return 1;
    }
    at++;
    uint64_t length, items;
    if (tag >= 0xa0 && tag <= 0xbf) { /* fixstr */
        length = tag & 0x1f;
    }
    else if (tag == 0xc4 || tag == 0xd9 || tag == 0xc5 || tag == 0xda || tag == 0xc6 ||
             tag == 0xdb) { /* bin or str, with a 1, 2 or 4-byte length */
        int size = (tag == 0xc4 || tag == 0xd9) ? 1 : (tag == 0xc5 || tag == 0xda) ? 2 : 4;
        if (end - at < size)
            return -1;
        length = read_be(at, size);
        at += size;
    }
    else {
        if (tag >= 0x90 && tag <= 0x9f) /* fixarray */
            items = tag & 0x0f;
        else if (tag >= 0x80 && tag <= 0x8f) /* fixmap: a key and a value each */
            items = 2 * (uint64_t)(tag & 0x0f);
        else if (tag == 0xdc || tag == 0xdd || tag == 0xde || tag == 0xdf) {
            int size = (tag == 0xdc || tag == 0xde) ? 2 : 4;
            if (end - at < size)
                return -1;
            items = read_be(at, size) * (tag >= 0xde ? 2 : 1);
            at += size;
        }
        else {
            return -1; /* ext types, 0xc1: not what an engine writes */
        }
        if (items > (uint64_t)(end - at) || walk->depth == PLAIN_MAX_DEPTH)
            return -1;
        walk->left[++walk->depth] = items;
        walk->at = at;
        return 1;
    }
    if (length > (uint64_t)(end - at))
        return -1;
    walk->at = at + length;
    return 1;
}

/* ``*cursor`` past ``count`` plain values: 1, or 0 where they are not all there and plain. */
static int
skip_plain(const unsigned char **cursor, const unsigned char *end, uint64_t count)
{
    Walk walk;
    int step;
    walk_start(&walk, *cursor, end, count);
    while ((step = walk_step(&walk)) > 0)
        ;
    *cursor = walk.at;
    return step == 0;
}

/* Past an array header (fixarray, array16, array32) whose count is in ``counts`` (a bit
 * per fixarray count; any count for the others): its count, or -1. */
static int64_t
array_header(const unsigned char **cursor, const unsigned char *end, unsigned counts)
{
    const unsigned char *at = *cursor;
    uint64_t count;
    if (at < end && (*at & 0xf0) == 0x90 && (counts >> (*at & 0x0f)) & 1) {
        count = *at & 0x0f;
        at++;
    }
    else if (counts == ~0u && at < end && (*at == 0xdc || *at == 0xdd)) {
        int size = *at == 0xdc ? 2 : 4;
        if (end - at < 1 + size)
            return -1;
        count = read_be(at + 1, size);
        at += 1 + size;
    }
    else {
        return -1;
    }
    if (count > (uint64_t)(end - at)) /* each value takes a byte at least */
        return -1;
    *cursor = at;
    return (int64_t)count;
}

/* Past a str or bin: a tag ``tag8`` (its 1-byte length form) or one of the two after it
 * (2- and 4-byte lengths), the length, and that many bytes: 1, with where they start
 * and how many; 0 where that is not what ``*cursor`` holds, or is cut short. */
static int
read_sized(const unsigned char **cursor, const unsigned char *end, unsigned char tag8,
           const unsigned char **bytes, uint64_t *length)
{
    const unsigned char *at = *cursor;
    if (at >= end || *at < tag8 || *at > tag8 + 2)
        return 0;
    int size = 1 << (*at - tag8);
    if (end - at < 1 + size)
        return 0;
    uint64_t read = read_be(at + 1, size);
    at += 1 + size;
    if (read > (uint64_t)(end - at))
        return 0;
    *bytes = at;
    *length = read;
    *cursor = at + read;
    return 1;
}

/* An envelope whose payload may be a plain KV batch, its events not walked yet. */
typedef struct {
    Walk events;
    int ranked; /* the batch has its third field, data_parallel_rank */
} Candidate;

/* Whether ``[at, end)`` is an envelope as kvbus writes it (``[version, kind, source,
 * epoch, seq, ts, payload]`` and maybe ``lost_from``, each plain, nothing after) whose
 * payload starts as a plain KV batch does: ``[ts, [event, ...]`` then maybe ``rank``,
 * with a float ts. Sets up the walk of the events that decides the rest. */
static int
envelope_candidate(const unsigned char *at, const unsigned char *end, Candidate *out)
{
    int64_t fields = array_header(&at, end, 1u << 7 | 1u << 8);
    if (fields < 0 || !skip_plain(&at, end, 6)) /* version .. ts */
        return 0;
    const unsigned char *payload;
    uint64_t length;
    if (!read_sized(&at, end, 0xc4, &payload, &length)) /* payload: bin8, bin16, bin32 */
        return 0;
    const unsigned char *payload_end = payload + length;
    if (fields == 8 && !skip_plain(&at, end, 1)) /* lost_from */
        return 0;
    if (at != end)
        return 0;
    int64_t batch_fields = array_header(&payload, payload_end, 1u << 2 | 1u << 3);
    if (batch_fields < 0 || payload == payload_end || (*payload != 0xca && *payload != 0xcb))
        return 0;
    if (payload_end - payload < SCALAR_BYTES[*payload]) /* ts */
        return 0;
    payload += SCALAR_BYTES[*payload];
    int64_t events = array_header(&payload, payload_end, ~0u);
    if (events < 0)
        return 0;
    walk_start(&out->events, payload, payload_end, (uint64_t)events);
    out->ranked = batch_fields == 3;
    return 1;
}

/* After its events: whether the batch ends as it should (an int or nil rank if it has
 * one, then the end of the payload). */
static int
batch_ends(const Candidate *candidate)
{
    const unsigned char *at = candidate->events.at, *end = candidate->events.end;
    if (candidate->ranked) {
        if (at == end || !(*at == 0xc0 || *at <= 0x7f || *at >= 0xe0 ||
                           (*at >= 0xcc && *at <= 0xd3)))
            return 0;
        if (end - at < SCALAR_BYTES[*at])
            return 0;
        at += SCALAR_BYTES[*at];
    }
    return at == end;
}

#define LANES 4 /* payloads walked side by side */

/* Every lane's walk past as many scalars as they all have in a row at their current
 * level, in step: the lanes' chains of dependent loads (a tag, then the next tag after
 * it) overlap, and the state stays in registers. Stops at anything else; walk_step
 * takes that. */
static inline void
scalars_in_step(Walk *const *walks)
{
    const unsigned char *at[LANES], *end[LANES];
    uint64_t most = UINT64_MAX, done = 0;
    for (int lane = 0; lane < LANES; lane++) {
        const Walk *walk = walks[lane];
        at[lane] = walk->at;
        end[lane] = walk->end;
        if (walk->left[walk->depth] < most)
            most = walk->left[walk->depth];
    }
    for (; done < most; done++) {
        unsigned size[LANES];
        int fits = 1;
        for (int lane = 0; lane < LANES; lane++) {
            size[lane] = at[lane] < end[lane] ? SCALAR_BYTES[*at[lane]] : 0;
            fits &= size[lane] != 0 && (size_t)(end[lane] - at[lane]) >= size[lane];
        }
        if (!fits)
            break;
        for (int lane = 0; lane < LANES; lane++)
            at[lane] += size[lane];
    }
    for (int lane = 0; lane < LANES; lane++) {
        Walk *walk = walks[lane];
        walk->at = at[lane];
        walk->left[walk->depth] -= done;
    }
}

/* Ask for ``data`` to be brought into the caches, with nothing waiting for it: a
 * slice's entries were written long enough ago to have left them (~25% faster). */
static inline void
prefetch(const char *data, Py_ssize_t size)
{
#if defined(__GNUC__) || defined(__clang__)
    for (Py_ssize_t line = 0; line < size; line += 64)
        __builtin_prefetch(data + line);
#endif
}

/* plain_kv_envelopes(datas) -> bytes: for each of ``datas`` (stored entries' bytes),
 * 1 where it is shaped as kvbus writes envelopes (seven or eight plain values, the
 * seventh a bin: the payload) and its payload is a KV batch as engines write it (a
 * float ts, plain events, an int or nil rank): where msgspec decodes the envelope,
 * kvbus.events.check_kv_batch accepts its payload. 0 says only that this may not be
 * so (anything else, including what is not bytes): the caller asks msgspec.
 *
 * Skipping a msgpack value needs its tag first, so one payload's walk is a chain of
 * dependent loads (~10 cycles a value); LANES payloads are walked side by side
 * (scalars_in_step), which lets the CPU overlap their chains: four take 0.6x the time
 * of two, and more gain nothing (the loop is then bound by its instructions). */
static PyObject *
plain_kv_envelopes(PyObject *module, PyObject *datas)
{
    PyObject *seq = PySequence_Fast(datas, "plain_kv_envelopes: datas must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, count);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    char *flags = PyBytes_AS_STRING(out);
    memset(flags, 0, (size_t)count);
    Candidate lanes[LANES];
    Walk *walks[LANES];
    Py_ssize_t owner[LANES]; /* the entry each lane walks; -1: none */
    for (int lane = 0; lane < LANES; lane++) {
        walks[lane] = &lanes[lane].events;
        owner[lane] = -1;
    }
    Py_ssize_t next = 0;
    for (;;) {
        int owned = 0;
        for (int lane = 0; lane < LANES; lane++) {
            while (owner[lane] < 0 && next < count) { /* give the lane its next entry */
                PyObject *ahead = next + LANES < count ? items[next + LANES] : NULL;
                if (ahead != NULL && PyBytes_Check(ahead)) /* the next round's, into cache */
                    prefetch(PyBytes_AS_STRING(ahead), PyBytes_GET_SIZE(ahead));
                PyObject *data = items[next];
                if (PyBytes_Check(data)) {
                    const unsigned char *at = (const unsigned char *)PyBytes_AS_STRING(data);
                    if (envelope_candidate(at, at + PyBytes_GET_SIZE(data), &lanes[lane]))
                        owner[lane] = next;
                }
                next++;
            }
            owned += owner[lane] >= 0;
        }
        if (owned == 0)
            break;
        if (owned == LANES)
            scalars_in_step(walks);
        for (int lane = 0; lane < LANES; lane++) {
            if (owner[lane] < 0)
                continue;
            int step = walk_step(&lanes[lane].events);
            if (step > 0)
                continue;
            flags[owner[lane]] = step == 0 && batch_ends(&lanes[lane]);
            owner[lane] = -1;
        }
    }
    Py_DECREF(seq);
    return out;
}

/* An unsigned msgpack int at ``*cursor`` (a positive fixint, uint8..uint64, or
 * int8..int64 holding a value >= 0): 1 with the value, and the cursor past it; else 0. */
static int
read_uint(const unsigned char **cursor, const unsigned char *end, uint64_t *value)
{
    const unsigned char *at = *cursor;
    if (at >= end)
        return 0;
    unsigned char tag = *at;
    if (tag <= 0x7f) {
        *value = tag;
        *cursor = at + 1;
        return 1;
    }
    if (tag < 0xcc || tag > 0xd3)
        return 0;
    int size = 1 << ((tag - 0xcc) & 3);
    if (end - at < 1 + size)
        return 0;
    uint64_t read = read_be(at + 1, size);
    if (tag >= 0xd0 && (read >> (8 * size - 1)) & 1) /* a negative int */
        return 0;
    *value = read;
    *cursor = at + 1 + size;
    return 1;
}

/* An envelope's fields, pointing into its bytes. */
typedef struct {
    uint64_t version, kind, epoch, seq;
    const unsigned char *source, *payload;
    Py_ssize_t source_size, payload_size;
    double ts;
} Fields;

/* Whether ``[at, end)`` is an envelope in the encodings kvbus writes (a fixarray of 7,
 * or of 8 ending in a lost_from of 0; unsigned ints, a str source, a float ts, a bin
 * payload): then msgspec decodes it to exactly ``out``, with lost_from 0. */
static int
read_envelope(const unsigned char *at, const unsigned char *end, Fields *out)
{
    if (at >= end || (*at != 0x97 && *at != 0x98))
        return 0;
    int ends_in_lost_from = *at++ == 0x98;
    if (!read_uint(&at, end, &out->version) || !read_uint(&at, end, &out->kind) || at >= end)
        return 0;
    uint64_t length;
    if (*at >= 0xa0 && *at <= 0xbf) { /* fixstr */
        length = *at++ & 0x1f;
        if (length > (uint64_t)(end - at))
            return 0;
        out->source = at;
        at += length;
    }
    else if (!read_sized(&at, end, 0xd9, &out->source, &length)) { /* str8, str16, str32 */
        return 0;
    }
    out->source_size = (Py_ssize_t)length;
    if (!read_uint(&at, end, &out->epoch) || !read_uint(&at, end, &out->seq) || at >= end)
        return 0;
    if (*at == 0xcb && end - at >= 9) { /* float64 */
        uint64_t bits = read_be(at + 1, 8);
        memcpy(&out->ts, &bits, 8);
        at += 9;
    }
    else if (*at == 0xca && end - at >= 5) { /* float32 */
        uint32_t bits = (uint32_t)read_be(at + 1, 4);
        float single;
        memcpy(&single, &bits, 4);
        out->ts = single;
        at += 5;
    }
    else {
        return 0;
    }
    if (!read_sized(&at, end, 0xc4, &out->payload, &length)) /* bin8, bin16, bin32 */
        return 0;
    out->payload_size = (Py_ssize_t)length;
    if (ends_in_lost_from && (at >= end || *at++ != 0x00))
        return 0;
    return at == end;
}

static PyObject *DATA, *POSITION, *SENDER; /* attribute names, interned at import */

/* kv_run(entries, start, vouched, max_bytes, schema_version, message, kind, body, order,
 * previous) -> (source, epoch, first_seq, items) | None: the subscriber's delivery of
 * a run of entries from ``start`` on, where nothing but the source's state (checked
 * by the caller, once per run) can stop them. A run is one source's KV batches,
 * consecutive seqs of one epoch, each vouched for (``vouched[i]``: see
 * plain_kv_envelopes), no larger than ``max_bytes``, of a schema version no newer,
 * with no gap marker, and either sent by that source or by no one known (``sender``).
 * ``items`` are what the caller's per-entry path would have queued for each:
 * (message(source, epoch, seq, kind, ts, body, payload, position, None), order,
 * position before it), with order counting on from ``order``. None where the entry at
 * ``start`` begins no run (anything else: that path decides). */
static PyObject *
kv_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "kv_run takes 10 arguments");
        return NULL;
    }
    PyObject *message = args[5], *kind = args[6], *body = args[7];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t max_bytes = PyLong_AsSsize_t(args[3]);
    if (max_bytes == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) { /* not an int: no runs */
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        PyErr_Clear();
        PyObject *zero = PyLong_FromLong(0);
        int negative = zero == NULL ? -1 : PyObject_RichCompareBool(args[3], zero, Py_LT);
        Py_XDECREF(zero);
        if (negative < 0)
            return NULL;
        if (negative) /* below any size: every entry is oversized */
            Py_RETURN_NONE;
        max_bytes = PY_SSIZE_T_MAX; /* beyond any size */
    }
    long schema_version = PyLong_AsLong(args[4]);
    long kind_value = PyLong_AsLong(kind);
    long long order = PyLong_AsLongLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "kv_run: vouched must be bytes");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "kv_run: entries must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **entries = PySequence_Fast_ITEMS(seq);
    const char *vouched = PyBytes_AS_STRING(args[2]);
    if (PyBytes_GET_SIZE(args[2]) < count)
        count = PyBytes_GET_SIZE(args[2]);
    PyObject *result = NULL, *items = NULL, *source = NULL, *epoch = NULL;
    PyObject *previous = Py_NewRef(args[9]);
    Fields first, fields;
    for (Py_ssize_t i = start; i >= 0 && i < count && vouched[i] == 1; i++) {
        PyObject *data = NULL, *sender = NULL, *position = NULL;
        PyObject *seq_number = NULL, *ts = NULL, *payload = NULL, *order_number = NULL;
        PyObject *delivered = NULL, *item = NULL;
        int taken = 0;
        data = PyObject_GetAttr(entries[i], DATA);
        sender = data == NULL ? NULL : PyObject_GetAttr(entries[i], SENDER);
        if (sender == NULL)
            goto entry_done;
        if (!PyBytes_CheckExact(data) || PyBytes_GET_SIZE(data) > max_bytes)
            goto entry_done;
        const unsigned char *at = (const unsigned char *)PyBytes_AS_STRING(data);
        Fields *read = i == start ? &first : &fields;
        if (!read_envelope(at, at + PyBytes_GET_SIZE(data), read) ||
            read->version > (uint64_t)schema_version || read->kind != (uint64_t)kind_value)
            goto entry_done;
        if (i == start) {
            source = PyUnicode_DecodeUTF8((const char *)first.source, first.source_size, NULL);
            if (source == NULL) { /* not UTF-8: msgspec refuses it, the caller says why */
                PyErr_Clear();
                goto entry_done;
            }
            epoch = PyLong_FromUnsignedLongLong(first.epoch);
            items = PyList_New(0);
            if (epoch == NULL || items == NULL)
                goto entry_done;
        }
        else if (fields.source_size != first.source_size ||
                 memcmp(fields.source, first.source, (size_t)first.source_size) != 0 ||
                 fields.epoch != first.epoch || fields.seq != first.seq + (uint64_t)(i - start) ||
                 fields.seq == 0) { /* 0: wrapped past 2**64 */
            goto entry_done;
        }
        if (sender != Py_None) { /* who the backend says sent it must be the source */
            Py_ssize_t size;
            const char *name = PyUnicode_Check(sender) ? PyUnicode_AsUTF8AndSize(sender, &size)
                                                        : NULL;
            if (name == NULL) {
                PyErr_Clear();
                goto entry_done;
            }
            if (size != first.source_size || memcmp(name, first.source, (size_t)size) != 0)
                goto entry_done;
        }
        position = PyObject_GetAttr(entries[i], POSITION);
        seq_number = PyLong_FromUnsignedLongLong(read->seq);
        ts = PyFloat_FromDouble(read->ts);
        payload = PyBytes_FromStringAndSize((const char *)read->payload, read->payload_size);
        order_number = PyLong_FromLongLong(order + (i - start));
        if (!position || !seq_number || !ts || !payload || !order_number)
            goto entry_done;
        PyObject *call[9] = {source, epoch, seq_number, kind, ts, body, payload, position, Py_None};
        delivered = PyObject_Vectorcall(message, call, 9, NULL);
        if (delivered == NULL)
            goto entry_done;
        item = PyTuple_Pack(3, delivered, order_number, previous);
        if (item == NULL || PyList_Append(items, item) < 0)
            goto entry_done;
        Py_SETREF(previous, Py_NewRef(position));
        taken = 1;
    entry_done:
        Py_XDECREF(data);
        Py_XDECREF(sender);
        Py_XDECREF(position);
        Py_XDECREF(seq_number);
        Py_XDECREF(ts);
        Py_XDECREF(payload);
        Py_XDECREF(order_number);
        Py_XDECREF(delivered);
        Py_XDECREF(item);
        if (!taken)
            break;
    }
    if (PyErr_Occurred())
        goto done;
    if (items == NULL || PyList_GET_SIZE(items) == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = Py_BuildValue("(OOKO)", source, epoch, (unsigned long long)first.seq, items);
done:
    Py_XDECREF(items);
    Py_XDECREF(source);
    Py_XDECREF(epoch);
    Py_DECREF(previous);
    Py_DECREF(seq);
    return result;
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
    {"plain_kv_envelopes", (PyCFunction)plain_kv_envelopes, METH_O, NULL},
    {"kv_run", (PyCFunction)(void (*)(void))kv_run, METH_FASTCALL, NULL},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, NULL},
    {"store_new", (PyCFunction)(void (*)(void))store_new, METH_FASTCALL, NULL},
    {"drop_only_copies", (PyCFunction)(void (*)(void))drop_only_copies, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvbus._ckernels",
    .m_doc = "Per-item loops of the index and the subscriber (kvbus/_kernels.py: the reference).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__ckernels(void)
{
    fill_item_tables(); /* constants: the same on every call */
    fill_scalar_table();
    key_iv_init();
    DATA = PyUnicode_InternFromString("data");
    POSITION = PyUnicode_InternFromString("position");
    SENDER = PyUnicode_InternFromString("sender");
    if (DATA == NULL || POSITION == NULL || SENDER == NULL)
        return NULL;
    return PyModuleDef_Init(&module);
}
