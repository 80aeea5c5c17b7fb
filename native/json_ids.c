/*
 * json_token_ids(data, key) -> (start, end, ids) | None: the top-level member `key` of a JSON
 * object document when it is an array of token ids: where it lies in `data`, and the ids as
 * native-order int32 bytes, read straight from the digits without a Python int per id.
 *
 * A client's token-id prompt is most of its request body: 128k ids are ~800 kB of digits, and
 * decoding them makes 128k Python ints and a list (orjson: ~4.9 ms on the development VM, the
 * largest part of a 128k request's fleet CPU; BENCHMARKS.md, "Token-id prompts without Python
 * ints"). The fleet needs only their count, their int32 form (the block hashes) and their bytes
 * (relayed to the executors as they came: shmdisagg/orchestrator/splice.py). So the member walk
 * of json_span.c reads the array here as it passes it, and the caller decodes the rest.
 *
 * Accepted: exactly what decoding the array and `token_ids_int32` accept together: a non-empty
 * array of JSON integers in [0, 2**31), with JSON's whitespace between tokens. A JSON integer is
 * `0` or a non-zero digit followed by digits (no sign, fraction, exponent or leading zero).
 * Anything else (an empty array, a nested one, a string, a float, an id out of range; or a later
 * duplicate of the key that is not such an array, since the last one counts) returns None, and
 * the caller decodes the body as usual, which refuses or accepts it as it always did: None is
 * never wrong, only slower.
 *
 * Speed: ids are read eight bytes at a time (SWAR: the digit run's length from one mask, its
 * value from three multiplies), ~2-3 ns an id instead of ~12 for a byte-at-a-time loop.
 */
#include "_native.h"

#define ONES 0x0101010101010101ULL

/* One id at p, scalar: its value (-1 if not a JSON integer in [0, 2**31)) and *next past it. */
static int64_t id_slow(const char *p, const char *end, const char **next)
{
    const char *d = p;
    uint64_t v = 0;
    while (p < end && (unsigned)(*p - '0') < 10 && p - d < 11) {
        v = v * 10 + (uint64_t)(*p - '0');
        p++;
    }
    *next = p;
    if (p == d || p - d > 10 || v > 0x7fffffffu || (*d == '0' && p - d > 1))
        return -1;
    return (int64_t)v;
}

/* One id at p with 8 readable bytes there: as id_slow, for runs of up to 7 digits (longer ones
 * go to id_slow). */
static inline int64_t id_fast(const char *p, const char *end, const char **next)
{
    uint64_t w;
    memcpy(&w, p, 8);
    uint64_t x = w ^ (ONES * '0');                                     /* digits -> 0..9 */
    uint64_t other = ((x + ONES * 0x76) | x) & (ONES * 0x80);          /* bytes above 9 */
    if (other == 0)
        return id_slow(p, end, next);                                  /* 8 digits or more */
    int len = __builtin_ctzll(other) >> 3;
    if (len == 0 || (len > 1 && *p == '0'))
        return -1;
    *next = p + len;
    uint64_t y = x << (8 * (8 - len));                                 /* leading zeros below */
    y = (y * 10 + (y >> 8)) & 0x00ff00ff00ff00ffULL;                   /* pairs */
    y = (y * 100 + (y >> 16)) & 0x0000ffff0000ffffULL;                 /* quads */
    return (int64_t)((y * 10000 + (y >> 32)) & 0xffffffffULL);       /* at most 9999999 */
}

struct ids {
    PyObject *out;  /* int32 bytes of the last matching array read whole, else NULL */
    Py_ssize_t n;
};

/* json_member_span's hook: read the array at v into a new bytes object; where it ends, or NULL
 * (not an id array: the walk skips it, and no ids are kept for it). */
static const char *read_ids(const char *v, const char *end, void *ctx)
{
    struct ids *r = ctx;
    Py_CLEAR(r->out);
    if (*v != '[')
        return NULL;
    /* every id but the last takes two bytes at least (a digit and a comma): room for the rest of
     * the document's; the unused tail is given back below (untouched pages were never mapped) */
    PyObject *out = PyBytes_FromStringAndSize(NULL, ((end - v) / 2 + 1) * 4);
    if (out == NULL) {
        PyErr_Clear();
        return NULL;
    }
    uint32_t *ids = (uint32_t *)PyBytes_AS_STRING(out);
    Py_ssize_t n = 0;
    const char *p = json_ws(v + 1, end);
    for (;;) {
        const char *q;
        int64_t id = end - p >= 8 ? id_fast(p, end, &q) : id_slow(p, end, &q);
        if (id < 0)
            goto fail;
        ids[n++] = (uint32_t)id;
        p = q;
        if (p < end && *p == ',') {  /* the usual case: a comma right after the id */
            p = json_ws(p + 1, end);
            continue;
        }
        p = json_ws(p, end);
        if (p >= end)
            goto fail;
        if (*p == ']')
            break;
        if (*p != ',')
            goto fail;
        p = json_ws(p + 1, end);
    }
    if (_PyBytes_Resize(&out, n * 4) < 0) {
        PyErr_Clear();
        return NULL;
    }
    r->out = out;
    r->n = n;
    return p + 1;
fail:
    Py_DECREF(out);
    return NULL;
}

PyObject *mod_json_token_ids(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "json_token_ids(data, key) takes two bytes arguments");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(args[0]);
    const char *end = s + PyBytes_GET_SIZE(args[0]);
    struct ids r = {NULL, 0};
    const char *found_end = NULL;
    const char *found = json_member_span(s, end, PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]), read_ids, &r,
                                         &found_end);
    /* the hook cleared the ids of every earlier duplicate: any left are the last member's */
    if (found == NULL || r.out == NULL) {
        Py_XDECREF(r.out);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(nnN)", (Py_ssize_t)(found - s), (Py_ssize_t)(found_end - s), r.out);
}

/*
 * json_long_digits(data) -> bool: whether `data` holds a run of LONG_DIGITS (19) or more ASCII
 * digits. A JSON integer outside [-2**63, 2**64) has at least 19 digits (-9223372036854775809),
 * and orjson decodes one as a float: its value changes (2**64 + 1 becomes 1.8446744073709552e+19)
 * and the legs would carry that. The fleet checks such a body again with exact integers
 * (shmdisagg/orchestrator/validation.py `exact_integers`); a run inside a string is only a
 * false alarm, which costs that second, exact decode.
 *
 * A run of 19 digits covers a whole 8-byte word at an offset that is a multiple of 8 (19 >=
 * 8 + 7), so only those words are looked at, eight bytes at a time (~0.1 ns a byte); a word of
 * digits is then measured byte by byte.
 */
#define LONG_DIGITS 19

static inline int is_digit(char c)
{
    return (unsigned)(c - '0') < 10;
}

PyObject *mod_json_long_digits(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "json_long_digits(data) takes one bytes argument");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    for (Py_ssize_t i = 0; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        uint64_t x = w ^ (ONES * '0');
        if ((((x + ONES * 0x76) | x) & (ONES * 0x80)) != 0)
            continue; /* a byte that is no digit */
        Py_ssize_t lo = i, hi = i + 8;
        while (lo > 0 && is_digit(s[lo - 1]))
            lo--;
        while (hi < n && is_digit(s[hi]))
            hi++;
        if (hi - lo >= LONG_DIGITS)
            Py_RETURN_TRUE;
        i = ((hi + 7) & ~(Py_ssize_t)7) - 8; /* on with the first word past the run */
    }
    Py_RETURN_FALSE;
}
