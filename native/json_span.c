/*
 * json_member(data, key) -> (start, end) | None: where the value of a top-level member of a JSON
 * object document lies in its bytes, without decoding it.
 *
 * The fleet worker relays token-id arrays it has no need to read as Python objects: the context
 * executor's `prompt_token_ids` go into the generation leg as they came, and a client's token-id
 * prompt into the context leg (shmdisagg/orchestrator/splice.py). Decoding a 128k-token array
 * makes 128k Python ints and encoding it again walks them once more; finding its bytes is one
 * pass over them here (BENCHMARKS.md, "prompt length").
 *
 * The walk follows JSON's grammar at depth 1 only as far as it needs to: member keys are compared
 * byte for byte, string values are skipped past their closing quote (escapes honoured), objects
 * and arrays by counting brackets outside strings, other values up to the next ',' or '}'. The
 * last member with the key wins, as a JSON decoder keeps the last of duplicate keys. None when
 * the key is absent, when the document is not an object as far as the walk can tell, or when
 * any top-level key is written with an escape (it could spell `key`): the caller then decodes
 * the document as usual, so None is never wrong, only slower. The value's own validity is the
 * decoder's business: callers decode the rest of the document, and splice the value into
 * another only where its first byte says what it is.
 */
#include "_native.h"

#include <emmintrin.h> /* SSE2: part of x86-64 */

/* Past the closing quote of the string whose opening quote is at p[-1]; NULL if unterminated.
 * *escaped is set when the string holds a backslash. */
static const char *skip_string(const char *p, const char *end, int *escaped)
{
    while (p < end) {
        const char *q = memchr(p, '"', (size_t)(end - p));
        if (q == NULL)
            return NULL;
        /* the quote ends the string unless an odd run of backslashes precedes it */
        const char *b = q;
        while (b > p && b[-1] == '\\')
            b--;
        if (b != q)
            *escaped = 1;
        if (((q - b) & 1) == 0)
            return q + 1;
        p = q + 1;
    }
    return NULL;
}

/* Past the ']' that closes the array opening at p when no '[', '{', '}' or '"' comes first (a
 * flat array of numbers: a token-id array), 16 bytes a step; NULL for any other array, which
 * skip_value then walks byte by byte to the same end. A 128k-token array: ~0.75 ms a byte at a
 * time, a few tens of µs here. */
static const char *skip_flat_array(const char *p, const char *end)
{
    const char *q = p + 1;
    const __m128i close = _mm_set1_epi8(']'), open = _mm_set1_epi8('['), obj = _mm_set1_epi8('{'),
                  obj_end = _mm_set1_epi8('}'), quote = _mm_set1_epi8('"');
    for (; end - q >= 16; q += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)q);
        unsigned closes = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, close));
        __m128i other = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, open), _mm_cmpeq_epi8(v, obj)),
                                     _mm_or_si128(_mm_cmpeq_epi8(v, obj_end), _mm_cmpeq_epi8(v, quote)));
        unsigned others = (unsigned)_mm_movemask_epi8(other);
        if ((closes | others) == 0)
            continue;
        unsigned first_close = closes ? (unsigned)__builtin_ctz(closes) : 16;
        if (others && (unsigned)__builtin_ctz(others) < first_close)
            return NULL;
        return q + first_close + 1;
    }
    for (; q < end; q++) {
        if (*q == ']')
            return q + 1;
        if (*q == '[' || *q == '{' || *q == '}' || *q == '"')
            return NULL;
    }
    return NULL;
}

/* Past the value starting at p (not whitespace); NULL if the walk cannot tell where it ends. */
static const char *skip_value(const char *p, const char *end)
{
    int escaped = 0;
    if (*p == '"')
        return skip_string(p + 1, end, &escaped);
    if (*p == '[') {
        const char *q = skip_flat_array(p, end);
        if (q != NULL)
            return q;
    }
    if (*p == '{' || *p == '[') {
        Py_ssize_t depth = 0;
        while (p < end) {
            char c = *p++;
            if (c == '"') {
                p = skip_string(p, end, &escaped);
                if (p == NULL)
                    return NULL;
            } else if (c == '{' || c == '[') {
                depth++;
            } else if (c == '}' || c == ']') {
                if (--depth == 0)
                    return p;
            }
        }
        return NULL;
    }
    while (p < end && *p != ',' && *p != '}' && *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
        p++;
    return p;
}

const char *json_member_span(const char *s, const char *end, const char *key, Py_ssize_t klen, json_value_hook hook,
                             void *ctx, const char **found_end)
{
    const char *found = NULL;
    const char *p = json_ws(s, end);
    if (p >= end || *p != '{')
        return NULL;
    p = json_ws(p + 1, end);
    if (p < end && *p == '}')
        return NULL;
    while (p < end) {
        if (*p != '"')
            return NULL;
        int escaped = 0;
        const char *k = p + 1;
        const char *kend = skip_string(k, end, &escaped);
        if (kend == NULL || escaped)
            return NULL;
        int match = (kend - 1 - k) == klen && memcmp(k, key, (size_t)klen) == 0;
        p = json_ws(kend, end);
        if (p >= end || *p != ':')
            return NULL;
        p = json_ws(p + 1, end);
        if (p >= end)
            return NULL;
        const char *v = p;
        p = match && hook != NULL ? hook(v, end, ctx) : NULL;
        if (p == NULL)
            p = skip_value(v, end);
        if (p == NULL || p == v)
            return NULL;
        if (match) {
            found = v;
            *found_end = p;
        }
        p = json_ws(p, end);
        if (p >= end)
            return NULL;
        if (*p == '}')
            return found;
        if (*p != ',')
            return NULL;
        p = json_ws(p + 1, end);
    }
    return NULL;
}

PyObject *mod_json_member(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "json_member(data, key) takes two bytes arguments");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(args[0]);
    const char *end = s + PyBytes_GET_SIZE(args[0]);
    const char *found_end = NULL;
    const char *found = json_member_span(s, end, PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]), NULL, NULL,
                                         &found_end);
    if (found == NULL)
        Py_RETURN_NONE;
    return Py_BuildValue("(nn)", (Py_ssize_t)(found - s), (Py_ssize_t)(found_end - s));
}
