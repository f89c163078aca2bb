/* The optimizer's busiest passes in C (engine.optimizer._native, loaded by
 * engine/optimizer/native.py):
 *
 *   merge                 variable merging's rounds (passes/variable_merging.py,
 *                         _merge_rounds), with the analysis they run on (analysis.py)
 *                         and the zeroing decisions after them
 *                         (passes/initialize_undefined.py, unnecessary_zeroings)
 *   convert_addition      passes/convert_addition.py
 *   extend_matrices       passes/extend_matrices.py (_extend, _fix_computation)
 *   move_sizing_commands  passes/move_sizing_commands.py
 *   allocation_pairs      passes/allocate_from_other.py (the pairs)
 *   renumber_submatrices  passes/renumber.py (the submatrix and matrix part)
 *
 * The Python passes are the reference: each function here decides the same things on
 * the same data, held as flat int arrays instead of lists of tuples.  Each reads the
 * computation first; whenever something is outside what it handles -- an error the
 * Python pass would report, a zeroing only the per-variable lists can decide, a value
 * out of range -- it returns None before changing anything, and the caller runs the
 * Python form, which then reports or decides it.  Most hand back what to change; merge
 * and renumber_submatrices make their edits themselves once every new object exists.
 * The GIL is held throughout (the only calls back into Python are reads and the
 * accesses_of callback, none of them during a sort).
 * tests/engine/test_native_passes.py compares the optimized computations of both forms.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdlib.h>
#include <string.h>

/* command types (engine.compiler.computation.CommandType, Kaldi's order) */
enum {
    ALLOC_MATRIX = 0, DEALLOC_MATRIX = 1, SWAP_MATRIX = 2, SET_CONST = 3, PROPAGATE = 4,
    BACKPROP = 5, BACKPROP_NO_MODEL_UPDATE = 6, MATRIX_COPY = 7, ACCEPT_INPUT = 18,
    PROVIDE_OUTPUT = 19, NO_OPERATION = 20, NUM_TYPES = 25
};
#define R_ 1
#define W_ 2
#define RW_ 3
#define MAX_SLOTS 4
#define STRIDE_EQUAL 1

/* Per command type, how its accesses are found (set by configure()):
 * kind 0: accesses nothing; 1: the slots below; 2: ask the Python callback. */
static int plan_kind[NUM_TYPES];
static int plan_n[NUM_TYPES];
static int plan_arg[NUM_TYPES][MAX_SLOTS];   /* 0-based argument slot */
static int plan_acc[NUM_TYPES][MAX_SLOTS];
static int plan_rule[NUM_TYPES][MAX_SLOTS];  /* 0 plain, 1 propagate adds, 2 backprop adds */
static long prop_propagate_in_place, prop_backprop_in_place, prop_propagate_adds,
    prop_backprop_adds;
static int configured = 0;

static PyObject *s_type, *s_alpha, *s_args[7];
/* a command's attributes in Command's field order: command_type, alpha, arg1..arg7 */
static PyObject *attr_names[9];

/* The attributes of engine.compiler.computation.Command (a slotted dataclass) are read
 * and written straight in their slots (configure_command), anything else's through
 * getattr / setattr */
static PyTypeObject *cmd_type = NULL;
static Py_ssize_t slot_offsets[9];

static PyObject *cmd_attr(PyObject *o, PyObject *name) {
    if (Py_TYPE(o) == cmd_type) {
        for (int i = 0; i < 9; i++) {
            if (attr_names[i] == name) {
                PyObject *v = *(PyObject **)((char *)o + slot_offsets[i]);
                if (!v) break;   /* unset: getattr raises the AttributeError */
                Py_INCREF(v);
                return v;
            }
        }
    }
    return PyObject_GetAttr(o, name);
}

/* command o's attribute i (attr_names) = v, a reference stolen; 0 or -1 */
static int store_attr(PyObject *o, int i, PyObject *v) {
    if (!v) return -1;
    if (Py_TYPE(o) == cmd_type) {
        PyObject **p = (PyObject **)((char *)o + slot_offsets[i]);
        PyObject *old = *p;
        *p = v;
        Py_XDECREF(old);
        return 0;
    }
    int r = PyObject_SetAttr(o, attr_names[i], v);
    Py_DECREF(v);
    return r;
}

/* the first k items of t, a tuple of k items (of at least k unless exact), as longs:
 * OK, FALLBACK (not such a tuple: the Python pass decides) or ERR (a Python error) */
#define OK 0
#define FALLBACK 1
#define ERR -1
static int read_ints(PyObject *t, int k, int exact, long *v) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < k || (exact && PyTuple_GET_SIZE(t) != k))
        return FALLBACK;
    for (int i = 0; i < k; i++) v[i] = PyLong_AsLong(PyTuple_GET_ITEM(t, i));
    return PyErr_Occurred() ? ERR : OK;
}

/* a command's alpha as a double: OK or ERR */
static int cmd_alpha(PyObject *cmd, double *alpha) {
    PyObject *a = cmd_attr(cmd, s_alpha);
    if (!a) return ERR;
    *alpha = PyFloat_AsDouble(a);
    Py_DECREF(a);
    return *alpha == -1.0 && PyErr_Occurred() ? ERR : OK;
}

/* a tuple of k ints, of the tuple subclass `type` (NULL: a plain tuple) */
static PyObject *ints_tuple(PyTypeObject *type, const int *v, int k) {
    PyObject *t = type ? type->tp_alloc(type, k) : PyTuple_New(k);
    if (!t) return NULL;
    for (int i = 0; i < k; i++) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (!x) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* SubMatrixInfo (configure_renumber) and CommandType.NO_OPERATION (configure) */
static PyTypeObject *subinfo_type = NULL;
static PyObject *no_op_obj = NULL;

/* -- growable arrays ---------------------------------------------------------------- */

typedef struct { int *d; Py_ssize_t n, cap; } ivec;
typedef struct { int ci, a, r0, r1, c0, c1; } entry;
typedef struct { entry *d; Py_ssize_t n, cap; } evec;

static int iv_push(ivec *v, int x) {
    if (v->n == v->cap) {
        Py_ssize_t cap = v->cap ? 2 * v->cap : 4;
        int *d = realloc(v->d, cap * sizeof(int));
        if (!d) return -1;
        v->d = d; v->cap = cap;
    }
    v->d[v->n++] = x;
    return 0;
}

static int ev_push(evec *v, int ci, int a, int r0, int r1, int c0, int c1) {
    if (v->n == v->cap) {
        Py_ssize_t cap = v->cap ? 2 * v->cap : 4;
        entry *d = realloc(v->d, cap * sizeof(entry));
        if (!d) return -1;
        v->d = d; v->cap = cap;
    }
    entry *e = &v->d[v->n++];
    e->ci = ci; e->a = a; e->r0 = r0; e->r1 = r1; e->c0 = c0; e->c1 = c1;
    return 0;
}

static int cmp_int(const void *x, const void *y) {
    int a = *(const int *)x, b = *(const int *)y;
    return (a > b) - (a < b);
}

/* -- state ---------------------------------------------------------------------------- */

typedef struct {
    Py_ssize_t n, ns, nm;
    /* commands: current type (merges turn some into no-ops), the type as given, the
     * arguments, alpha == 0 / alpha == 1 (only read for the types that need them) */
    int *ct, *ct0, *arg;
    char *alpha0, *alpha1, *cleared;
    long *cprops;            /* properties of arg1's component (-1: not asked yet) */
    /* the command accesses: cacc_s/cacc_a[cacc_at[c] .. + cacc_n[c]] */
    Py_ssize_t *cacc_at;
    int *cacc_n;
    ivec acc_s, acc_a;
    /* submatrices as the computation has them now (merges move them) and as given */
    int *sm, *sro, *snr, *sco, *snc, *sm0, *sro0, *sco0;
    /* the analysis's view of each submatrix (brought up to date between rounds) */
    int *as2m, *ar0, *ar1, *ac0, *ac1;
    char *awhole;
    /* matrices */
    int *rows, *cols, *stride, *stride0;
    int *alloc, *dealloc;
    char *is_in, *is_out;
    evec *ent;               /* the accesses of each matrix, in command order */
    ivec *of;                /* matrix -> its submatrices, increasing */
    /* one round */
    evec *dirty;             /* per matrix: rectangles of the kept submatrices */
    ivec dirty_mats;
    char *moved;             /* per submatrix */
    ivec moved_list;
    char *in_group;          /* per matrix: a receiving matrix of this round */
    ivec *group;             /* receiving matrix -> itself and the ones it took */
    ivec keeps;              /* the receiving matrices, in the order of their first merge */
    char by_number;
    char bad;                /* an argument out of range was read: the Python pass decides */
    /* candidates */
    char *is_cand, *is_settled;
    int *key;                /* the submatrix order key (NULL until the first merge) */
    /* options */
    int remove_assignments, propagate_in_place, backprop_in_place, allow_left, allow_right;
    PyObject *commands, *subs, *props, *accesses_of;
} M;

static void m_free(M *m) {
    free(m->ct); free(m->ct0); free(m->arg); free(m->alpha0); free(m->alpha1);
    free(m->cleared); free(m->cprops); free(m->cacc_at); free(m->cacc_n);
    free(m->acc_s.d); free(m->acc_a.d);
    free(m->sm); free(m->sro); free(m->snr); free(m->sco); free(m->snc);
    free(m->sm0); free(m->sro0); free(m->sco0);
    free(m->as2m); free(m->ar0); free(m->ar1); free(m->ac0); free(m->ac1); free(m->awhole);
    free(m->rows); free(m->cols); free(m->stride); free(m->stride0);
    free(m->alloc); free(m->dealloc); free(m->is_in); free(m->is_out);
    if (m->ent) for (Py_ssize_t i = 0; i < m->nm; i++) free(m->ent[i].d);
    if (m->of) for (Py_ssize_t i = 0; i < m->nm; i++) free(m->of[i].d);
    if (m->dirty) for (Py_ssize_t i = 0; i < m->nm; i++) free(m->dirty[i].d);
    if (m->group) for (Py_ssize_t i = 0; i < m->nm; i++) free(m->group[i].d);
    free(m->ent); free(m->of); free(m->dirty); free(m->group);
    free(m->dirty_mats.d); free(m->moved); free(m->moved_list.d); free(m->in_group);
    free(m->keeps.d); free(m->is_cand); free(m->is_settled); free(m->key);
}

static long as_long(PyObject *o, int *err) {
    if (!o) { *err = 1; return 0; }
    long v = PyLong_AsLong(o);
    Py_DECREF(o);
    if (v == -1 && PyErr_Occurred()) *err = 1;
    return v;
}

static int get_arg(M *m, PyObject *cmd, Py_ssize_t c, int i) {
    /* argument i (0-based) of command c, read once */
    int *slot = &m->arg[c * 7 + i];
    if (*slot == -2) {
        int err = 0;
        long v = as_long(cmd_attr(cmd, s_args[i]), &err);
        if (err) return -3;
        if (v < -1 || v > 0x7fffffff) {   /* not what a compiled computation holds */
            m->bad = 1;
            v = -1;
        }
        *slot = (int)v;
    }
    return *slot;
}

static int read_alpha(M *m, PyObject *cmd, Py_ssize_t c) {
    double v;
    if (cmd_alpha(cmd, &v)) return ERR;
    m->alpha0[c] = v == 0.0;
    m->alpha1[c] = v == 1.0;
    return OK;
}

static long comp_props(M *m, Py_ssize_t c) {
    /* the properties of the component command c names (arg1); -2 on error */
    if (m->cprops[c] == -1) {
        int err = 0;
        PyObject *k = PyLong_FromLong(m->arg[c * 7]);
        if (!k) return -2;
        long v = as_long(PyObject_GetItem(m->props, k), &err);
        Py_DECREF(k);
        if (err) return -2;
        m->cprops[c] = v;
    }
    return m->cprops[c];
}

#define ALLOC(p, k) do { size_t k_ = (size_t)(k); (p) = calloc(k_ ? k_ : 1, sizeof(*(p))); \
        if (!(p)) { PyErr_NoMemory(); return ERR; } } while (0)

/* Read the computation.  Returns OK, FALLBACK or ERR. */
static int m_read(M *m, PyObject *commands, PyObject *subs, PyObject *mats) {
    Py_ssize_t n = m->n = PyList_GET_SIZE(commands);
    Py_ssize_t ns = m->ns = PyList_GET_SIZE(subs);
    Py_ssize_t nm = m->nm = PyList_GET_SIZE(mats);
    ALLOC(m->ct, n); ALLOC(m->ct0, n); ALLOC(m->arg, n * 7); ALLOC(m->alpha0, n);
    ALLOC(m->alpha1, n); ALLOC(m->cleared, n); ALLOC(m->cprops, n);
    ALLOC(m->cacc_at, n); ALLOC(m->cacc_n, n); ALLOC(m->is_cand, n); ALLOC(m->is_settled, n);
    ALLOC(m->sm, ns); ALLOC(m->sro, ns); ALLOC(m->snr, ns); ALLOC(m->sco, ns);
    ALLOC(m->snc, ns); ALLOC(m->sm0, ns); ALLOC(m->sro0, ns); ALLOC(m->sco0, ns);
    ALLOC(m->as2m, ns); ALLOC(m->ar0, ns); ALLOC(m->ar1, ns); ALLOC(m->ac0, ns);
    ALLOC(m->ac1, ns); ALLOC(m->awhole, ns); ALLOC(m->moved, ns);
    ALLOC(m->rows, nm); ALLOC(m->cols, nm); ALLOC(m->stride, nm); ALLOC(m->stride0, nm);
    ALLOC(m->alloc, nm); ALLOC(m->dealloc, nm); ALLOC(m->is_in, nm); ALLOC(m->is_out, nm);
    ALLOC(m->ent, nm); ALLOC(m->of, nm); ALLOC(m->dirty, nm); ALLOC(m->group, nm);
    ALLOC(m->in_group, nm);
    for (Py_ssize_t i = 0; i < n * 7; i++) m->arg[i] = -2;   /* not read yet */
    for (Py_ssize_t i = 0; i < n; i++) m->cprops[i] = -1;
    for (Py_ssize_t j = 0; j < nm; j++) {
        long v[3];
        int rc = read_ints(PyList_GET_ITEM(mats, j), 3, 0, v);
        if (rc) return rc;
        m->rows[j] = (int)v[0]; m->cols[j] = (int)v[1]; m->stride[j] = m->stride0[j] = (int)v[2];
        m->alloc[j] = m->dealloc[j] = -1;
    }
    for (Py_ssize_t s = 1; s < ns; s++) {
        long v[5];
        int rc = read_ints(PyList_GET_ITEM(subs, s), 5, 1, v);
        if (rc) return rc;
        if (!(0 < v[0] && v[0] < nm)) return FALLBACK;   /* the analysis reports it */
        int mm = (int)v[0];
        m->sm[s] = m->sm0[s] = mm; m->sro[s] = m->sro0[s] = (int)v[1];
        m->snr[s] = (int)v[2]; m->sco[s] = m->sco0[s] = (int)v[3]; m->snc[s] = (int)v[4];
        m->as2m[s] = mm;
        m->awhole[s] = v[1] == 0 && v[3] == 0 && v[2] == m->rows[mm] && v[4] == m->cols[mm];
        m->ar0[s] = (int)v[1]; m->ar1[s] = (int)(v[1] + v[2]);
        m->ac0[s] = (int)v[3]; m->ac1[s] = (int)(v[3] + v[4]);
        if (iv_push(&m->of[mm], (int)s)) { PyErr_NoMemory(); return ERR; }
    }
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *cmd = PyList_GET_ITEM(commands, c);
        int err = 0;
        long t = as_long(cmd_attr(cmd, s_type), &err);
        if (err) return ERR;
        if (t < 0 || t >= NUM_TYPES) return FALLBACK;
        m->ct[c] = m->ct0[c] = (int)t;
        if (t == SET_CONST || t == MATRIX_COPY)
            if (read_alpha(m, cmd, c)) return ERR;
    }
    return OK;
}

/* -- the analysis (Analyzer.__init__) ------------------------------------------------- */

static int add_access(M *m, Py_ssize_t c, int s, int a) {
    if (iv_push(&m->acc_s, s) || iv_push(&m->acc_a, a)) { PyErr_NoMemory(); return ERR; }
    m->cacc_n[c]++;
    if (ev_push(&m->ent[m->as2m[s]], (int)c, a, m->ar0[s], m->ar1[s], m->ac0[s], m->ac1[s])) {
        PyErr_NoMemory();
        return ERR;
    }
    return OK;
}

/* the matrix of whole submatrix s (argument of a sizing / io command), or -1 */
static int whole_matrix(M *m, int s) {
    if (0 < s && s < m->ns && m->awhole[s]) return m->as2m[s];
    return -1;
}

/* _Life.apply for command c; only matrices with in_group set when only_groups */
static int life_apply(M *m, Py_ssize_t c, int only_groups) {
    int t = m->ct[c];
    PyObject *cmd = PyList_GET_ITEM(m->commands, c);
    int s1 = get_arg(m, cmd, c, 0);
    if (s1 == -3) return ERR;
    if (t == ALLOC_MATRIX || t == DEALLOC_MATRIX || t == ACCEPT_INPUT || t == PROVIDE_OUTPUT) {
        int mm = whole_matrix(m, s1);
        if (mm < 0) return FALLBACK;
        if (only_groups && !m->in_group[mm]) return OK;
        if (t == ALLOC_MATRIX) {
            if (m->alloc[mm] != -1) return FALLBACK;
            m->alloc[mm] = (int)c;
        } else if (t == DEALLOC_MATRIX) {
            if (m->dealloc[mm] != -1) return FALLBACK;
            m->dealloc[mm] = (int)c;
        } else if (t == ACCEPT_INPUT) {
            m->is_in[mm] = 1;
            if (m->alloc[mm] == -1) m->alloc[mm] = (int)c;
        } else {
            m->is_out[mm] = 1;
        }
    } else if (t == SWAP_MATRIX) {
        int s2 = get_arg(m, cmd, c, 1);
        if (s2 == -3) return ERR;
        int ma = whole_matrix(m, s1), mb = whole_matrix(m, s2);
        if (ma < 0 || mb < 0) return FALLBACK;
        if (!only_groups || m->in_group[ma]) {
            if (m->alloc[ma] != -1) return FALLBACK;
            m->alloc[ma] = (int)c;
        }
        if (!only_groups || m->in_group[mb]) {
            if (m->dealloc[mb] != -1) return FALLBACK;
            m->dealloc[mb] = (int)c;
        }
    }
    return OK;
}

static int m_analyze(M *m) {
    for (Py_ssize_t c = 0; c < m->n; c++) {
        PyObject *cmd = PyList_GET_ITEM(m->commands, c);
        int t = m->ct[c];
        m->cacc_at[c] = m->acc_s.n;
        if (plan_kind[t] == 1) {
            for (int k = 0; k < plan_n[t]; k++) {
                int s = get_arg(m, cmd, c, plan_arg[t][k]);
                if (s == -3) return ERR;
                if (s <= 0) continue;
                if (s >= m->ns) return FALLBACK;
                int a = plan_acc[t][k];
                if (plan_rule[t][k]) {
                    if (get_arg(m, cmd, c, 0) == -3) return ERR;
                    long p = comp_props(m, c);
                    if (p == -2) return ERR;
                    if (p & (plan_rule[t][k] == 1 ? prop_propagate_adds : prop_backprop_adds))
                        a = RW_;
                }
                if (add_access(m, c, s, a)) return ERR;
            }
        } else if (plan_kind[t] == 2) {
            PyObject *lst = PyObject_CallOneArg(m->accesses_of, cmd);
            if (!lst) return ERR;
            if (!PyList_Check(lst)) { Py_DECREF(lst); return FALLBACK; }
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(lst); k++) {
                PyObject *pr = PyList_GET_ITEM(lst, k);
                long s = PyLong_AsLong(PyTuple_GET_ITEM(pr, 0));
                long a = PyLong_AsLong(PyTuple_GET_ITEM(pr, 1));
                if (PyErr_Occurred()) { Py_DECREF(lst); return ERR; }
                if (s <= 0 || s >= m->ns) { Py_DECREF(lst); return FALLBACK; }
                if (add_access(m, c, (int)s, (int)a)) { Py_DECREF(lst); return ERR; }
            }
            Py_DECREF(lst);
        }
        if (t == ALLOC_MATRIX || t == DEALLOC_MATRIX || t == SWAP_MATRIX || t == ACCEPT_INPUT
                || t == PROVIDE_OUTPUT) {
            int r = life_apply(m, c, 0);
            if (r) return r;
        }
    }
    return OK;
}

/* -- the merge candidates (merge_candidates) ------------------------------------------- */

/* (s1, s2) of a candidate command, or 0 when it is not one; FALLBACK/ERR codes < 0 */
static int candidate_args(M *m, Py_ssize_t c, int *s1, int *s2) {
    int t = m->ct0[c];
    PyObject *cmd = PyList_GET_ITEM(m->commands, c);
    *s1 = *s2 = -1;
    if (t == MATRIX_COPY && m->remove_assignments) {
        *s2 = get_arg(m, cmd, c, 0); *s1 = get_arg(m, cmd, c, 1);
    } else if (t == PROPAGATE && m->propagate_in_place) {
        if (get_arg(m, cmd, c, 0) == -3) return -2;
        long p = comp_props(m, c);
        if (p == -2) return -2;
        if (!(p & prop_propagate_in_place)) return 0;
        *s1 = get_arg(m, cmd, c, 2); *s2 = get_arg(m, cmd, c, 3);
    } else if ((t == BACKPROP || t == BACKPROP_NO_MODEL_UPDATE) && m->backprop_in_place) {
        if (get_arg(m, cmd, c, 0) == -3) return -2;
        long p = comp_props(m, c);
        if (p == -2) return -2;
        if (!(p & prop_backprop_in_place)) return 0;
        *s1 = get_arg(m, cmd, c, 4); *s2 = get_arg(m, cmd, c, 5);
        if (get_arg(m, cmd, c, 2) == -3 || get_arg(m, cmd, c, 3) == -3) return -2;
    } else {
        return 0;
    }
    if (*s1 == -3 || *s2 == -3) return -2;
    if (*s1 >= m->ns || *s2 >= m->ns) return -1;
    return *s1 > 0 && *s2 > 0;
}

/* -- one round (VariableMergingOptimizer) ----------------------------------------------- */

static int overlaps(int R0, int R1, int C0, int C1, const entry *e) {
    return e->r0 < R1 && R0 < e->r1 && e->c0 < C1 && C0 < e->c1;
}

static int same_extent(M *m, int s, int t) {
    return m->sm[s] == m->sm[t] && m->sro[s] == m->sro[t] && m->snr[s] == m->snr[t]
        && m->sco[s] == m->sco[t] && m->snc[s] == m->snc[t];
}

static int same_sub(M *m, int s, int t) {
    if (s == t) return 1;
    return !m->by_number && s > 0 && t > 0 && same_extent(m, s, t);
}

static int is_dirty(M *m, int s) {
    if (m->moved[s]) return 1;
    evec *rects = &m->dirty[m->sm[s]];
    int R0 = m->sro[s], R1 = R0 + m->snr[s], C0 = m->sco[s], C1 = C0 + m->snc[s];
    for (Py_ssize_t i = 0; i < rects->n; i++)
        if (overlaps(R0, R1, C0, C1, &rects->d[i])) return 1;
    return 0;
}

static int is_zeroing(M *m, int c) {
    return m->ct[c] == SET_CONST && m->alpha0[c];
}

/* ComputationAnalysis.first_use_at */
static int first_use_at(M *m, int s, int c) {
    evec *ents = &m->ent[m->sm[s]];
    int R0 = m->sro[s], R1 = R0 + m->snr[s], C0 = m->sco[s], C1 = C0 + m->snc[s];
    Py_ssize_t i = 0;
    for (; i < ents->n; i++) {
        entry *e = &ents->d[i];
        if (overlaps(R0, R1, C0, C1, e) && !is_zeroing(m, e->ci)) break;
    }
    if (i == ents->n) return -1;
    if (ents->d[i].ci != c) return -1;
    int ans = m->dealloc[m->sm[s]];
    if (ans == -1) ans = (int)m->n;
    for (i++; i < ents->n; i++) {
        entry *e = &ents->d[i];
        if (e->ci > c && (e->a & W_) && overlaps(R0, R1, C0, C1, e))
            return ans < e->ci ? ans : e->ci;
    }
    return ans;
}

/* ComputationAnalysis.last_access_and_write */
static void last_access_and_write(M *m, int s, int *last, int *last_write) {
    int mm = m->sm[s];
    evec *ents = &m->ent[mm];
    int R0 = m->sro[s], R1 = R0 + m->snr[s], C0 = m->sco[s], C1 = C0 + m->snc[s];
    int output = m->is_out[mm];
    *last = -1;
    for (Py_ssize_t i = ents->n - 1; i >= 0; i--) {
        entry *e = &ents->d[i];
        if (!overlaps(R0, R1, C0, C1, e)) continue;
        if (*last == -1) {
            *last = e->ci;
            if (output) break;
        }
        if (e->a & W_) {
            *last_write = output ? (int)m->n : e->ci;
            return;
        }
    }
    *last_write = output ? (int)m->n : -1;
}

static int last_access(M *m, int s) {
    evec *ents = &m->ent[m->sm[s]];
    int R0 = m->sro[s], R1 = R0 + m->snr[s], C0 = m->sco[s], C1 = C0 + m->snc[s];
    for (Py_ssize_t i = ents->n - 1; i >= 0; i--)
        if (overlaps(R0, R1, C0, C1, &ents->d[i])) return ents->d[i].ci;
    return -1;
}

static int cmd_index(M *m, int c) {
    /* a command index as Python's list indexing takes it (-1: the last) */
    return c < 0 ? (int)m->n + c : c;
}

static int alloc_precedes(M *m, int keep, int discard) {
    if (m->ct[cmd_index(m, m->alloc[discard])] == ACCEPT_INPUT) return 1;
    int first = (int)m->n;
    evec *ents = &m->ent[discard];
    for (Py_ssize_t i = 0; i < ents->n; i++) {
        int c = ents->d[i].ci;
        if (!is_zeroing(m, c)) { first = c; break; }
    }
    return first > m->alloc[keep];
}

static int kept_side(M *m, int ci, int s1, int s2, int left, int right) {
    if (m->dirty_mats.n || m->moved_list.n)
        if (is_dirty(m, s1) || is_dirty(m, s2)) return 0;
    int m1 = m->as2m[s1], m2 = m->as2m[s2];
    int whole1 = m->awhole[s1], whole2 = m->awhole[s2];
    if ((m->is_in[m1] && m->is_in[m2]) || (m->is_out[m1] && m->is_out[m2])) return 0;
    if ((m->is_in[m1] || m->is_out[m1] || m->is_in[m2] || m->is_out[m2]) && !(whole1 && whole2))
        return 0;
    if (!whole1 && m->stride[m2] == STRIDE_EQUAL) left = 0;
    if (!whole2 && m->stride[m1] == STRIDE_EQUAL) right = 0;
    if (!(left || right)) return 0;
    int invalidated = first_use_at(m, s2, ci);
    if (invalidated < 0) return 0;
    if (m->ct[ci] == MATRIX_COPY && m->alpha1[ci]) {
        int last, last_write;
        last_access_and_write(m, s1, &last, &last_write);
        if (!(last_write < ci && last < invalidated)) return 0;
    } else if (last_access(m, s1) != ci) {
        return 0;
    }
    if (left && alloc_precedes(m, m1, m2)) return s1;
    if (right && alloc_precedes(m, m2, m1)) return s2;
    return 0;
}

static int do_merge(M *m, int ci, int s_keep, int s_discard) {
    int m_keep = m->sm[s_keep], ro = m->sro[s_keep], nr = m->snr[s_keep];
    int co = m->sco[s_keep], nc = m->snc[s_keep];
    int m_discard = m->sm[s_discard];
    if (m_keep == m_discard || m_keep <= 0 || m_discard <= 0) return FALLBACK;
    if (m->dirty[m_keep].n == 0 && iv_push(&m->dirty_mats, m_keep)) goto nomem;
    if (ev_push(&m->dirty[m_keep], 0, 0, ro, ro + nr, co, co + nc)) goto nomem;
    ivec *subs_d = &m->of[m_discard];
    for (Py_ssize_t i = 0; i < subs_d->n; i++) {
        int s = subs_d->d[i];
        if (!m->moved[s]) {
            m->moved[s] = 1;
            if (iv_push(&m->moved_list, s)) goto nomem;
        }
    }
    if (!m->in_group[m_keep]) {
        m->in_group[m_keep] = 1;
        m->group[m_keep].n = 0;
        if (iv_push(&m->group[m_keep], m_keep) || iv_push(&m->keeps, m_keep)) goto nomem;
    }
    if (iv_push(&m->group[m_keep], m_discard)) goto nomem;
    for (Py_ssize_t i = 0; i < subs_d->n; i++) {
        int s = subs_d->d[i];
        m->sm[s] = m_keep;
        m->sro[s] += ro;
        m->sco[s] += co;
    }
    if (m->ct[ci] == MATRIX_COPY && m->alpha1[ci]) {
        m->ct[ci] = NO_OPERATION;
        m->cleared[ci] = 1;
    }
    if (m->dealloc[m_discard] != -1) {
        m->ct[cmd_index(m, m->dealloc[m_discard])] = NO_OPERATION;
    } else {
        if (m->dealloc[m_keep] == -1) return FALLBACK;
        m->ct[cmd_index(m, m->dealloc[m_keep])] = NO_OPERATION;
    }
    int alloc_keep = m->alloc[m_keep], alloc_discard = m->alloc[m_discard];
    if (alloc_keep == -1 || alloc_discard == -1) return FALLBACK;
    int zero_of;
    if (m->ct[alloc_discard] == ACCEPT_INPUT) {
        m->ct[alloc_keep] = NO_OPERATION;
        zero_of = m_keep;
    } else {
        m->ct[alloc_discard] = NO_OPERATION;
        zero_of = m_discard;
    }
    evec *ents = &m->ent[zero_of];
    if (ents->n) {
        int z = ents->d[0].ci;
        if (is_zeroing(m, z)) m->ct[z] = NO_OPERATION;
    }
    if (m->stride[m_discard] == STRIDE_EQUAL) m->stride[m_keep] = STRIDE_EQUAL;
    return OK;
nomem:
    PyErr_NoMemory();
    return ERR;
}

/* merge_variables over the candidate commands `cands` (increasing); *merged set when
 * something merged; settled commands flagged in is_settled */
static int merge_round(M *m, ivec *cands, int *merged) {
    *merged = 0;
    for (Py_ssize_t i = 0; i < cands->n; i++) {
        int ci = cands->d[i];
        int s1, s2;
        int r = candidate_args(m, ci, &s1, &s2);
        if (r < 0) return r == -2 ? ERR : FALLBACK;
        if (r == 0) continue;
        int t = m->ct0[ci];
        if (t == BACKPROP || t == BACKPROP_NO_MODEL_UPDATE) {
            int in_v = m->arg[ci * 7 + 2], out_v = m->arg[ci * 7 + 3];
            if (same_sub(m, in_v, s1) || same_sub(m, in_v, s2) || same_sub(m, out_v, s1)
                    || same_sub(m, out_v, s2))
                continue;
        }
        int left = m->allow_left && m->awhole[s2], right = m->allow_right && m->awhole[s1];
        if (!(left || right) || m->sm[s1] == m->sm[s2]) {
            m->is_settled[ci] = 1;
            continue;
        }
        int keep = kept_side(m, ci, s1, s2, left, right);
        if (keep) {
            int rr = keep == s1 ? do_merge(m, ci, s1, s2) : do_merge(m, ci, s2, s1);
            if (rr) return rr;
            m->is_settled[ci] = 1;
            *merged = 1;
        }
    }
    return OK;
}

static void round_reset(M *m) {
    for (Py_ssize_t i = 0; i < m->dirty_mats.n; i++) m->dirty[m->dirty_mats.d[i]].n = 0;
    m->dirty_mats.n = 0;
    for (Py_ssize_t i = 0; i < m->moved_list.n; i++) m->moved[m->moved_list.d[i]] = 0;
    m->moved_list.n = 0;
    for (Py_ssize_t i = 0; i < m->keeps.n; i++) m->in_group[m->keeps.d[i]] = 0;
    m->keeps.n = 0;
}

/* -- Analyzer.reanalyze ---------------------------------------------------------------- */

static int reanalyze(M *m, char *used, char *touched, ivec *touched_list) {
    ivec life = {0};
    int rc = OK;
    for (Py_ssize_t g = 0; g < m->keeps.n; g++) {
        int keep = m->keeps.d[g];
        ivec *grp = &m->group[keep];
        ivec moved = {0};
        for (Py_ssize_t k = 0; k < grp->n; k++) {
            int mm = grp->d[k];
            evec *e = &m->ent[mm];
            for (Py_ssize_t i = 0; i < e->n; i++) {
                int c = e->d[i].ci;
                if (!touched[c]) { touched[c] = 1; if (iv_push(touched_list, c)) goto nomem; }
            }
            if (iv_push(&life, m->alloc[mm]) || iv_push(&life, m->dealloc[mm])) goto nomem;
            if (mm != keep) {
                for (Py_ssize_t i = 0; i < m->of[mm].n; i++)
                    if (iv_push(&moved, m->of[mm].d[i])) goto nomem;
                m->of[mm].n = 0;
                m->ent[mm].n = 0;
                m->alloc[mm] = m->dealloc[mm] = -1;
                m->is_in[mm] = m->is_out[mm] = 0;
            }
        }
        for (Py_ssize_t i = 0; i < moved.n; i++) {
            int s = moved.d[i];
            int ro = m->sro[s], nr = m->snr[s], co = m->sco[s], nc = m->snc[s];
            m->as2m[s] = m->sm[s];
            m->awhole[s] = ro == 0 && co == 0 && nr == m->rows[keep] && nc == m->cols[keep];
            m->ar0[s] = ro; m->ar1[s] = ro + nr; m->ac0[s] = co; m->ac1[s] = co + nc;
            if (iv_push(&m->of[keep], s)) { free(moved.d); goto nomem; }
        }
        free(moved.d);
        qsort(m->of[keep].d, m->of[keep].n, sizeof(int), cmp_int);
        m->ent[keep].n = 0;
        m->alloc[keep] = m->dealloc[keep] = -1;
        m->is_in[keep] = m->is_out[keep] = 0;
    }
    qsort(touched_list->d, touched_list->n, sizeof(int), cmp_int);
    for (Py_ssize_t i = 0; i < touched_list->n; i++) {
        int c = touched_list->d[i];
        int t = m->ct[c];
        if (t == NO_OPERATION) { m->cacc_n[c] = 0; continue; }
        for (int k = 0; k < m->cacc_n[c]; k++) {
            int s = m->acc_s.d[m->cacc_at[c] + k], a = m->acc_a.d[m->cacc_at[c] + k];
            int mm = m->as2m[s];
            if (m->in_group[mm]) {
                used[s] = 1;
                if (ev_push(&m->ent[mm], c, a, m->ar0[s], m->ar1[s], m->ac0[s], m->ac1[s]))
                    goto nomem;
            }
        }
        if (t == ACCEPT_INPUT || t == PROVIDE_OUTPUT)
            if (iv_push(&life, c)) goto nomem;
    }
    qsort(life.d, life.n, sizeof(int), cmp_int);
    for (Py_ssize_t i = 0; i < life.n; i++) {
        int c = life.d[i];
        if (c == -1 || (i > 0 && life.d[i - 1] == c)) continue;
        int t = m->ct[c];
        if (t == NO_OPERATION) { m->cacc_n[c] = 0; continue; }
        PyObject *cmd = PyList_GET_ITEM(m->commands, c);
        int s = get_arg(m, cmd, c, 0);
        if (s == -3) { rc = ERR; goto out; }
        rc = life_apply(m, c, 1);
        if (rc) goto out;
        int ss[2] = {s, -1}, k2 = 1;
        if (t == SWAP_MATRIX) {
            ss[1] = get_arg(m, cmd, c, 1);
            if (ss[1] == -3) { rc = ERR; goto out; }
            k2 = 2;
        }
        for (int k = 0; k < k2; k++) {
            int x = ss[k];
            if (x <= 0 || x >= m->ns) { rc = FALLBACK; goto out; }
            if (m->in_group[m->as2m[x]]) used[x] = 1;
        }
    }
out:
    free(life.d);
    return rc;
nomem:
    free(life.d);
    PyErr_NoMemory();
    return ERR;
}

/* -- _SubmatrixOrder ------------------------------------------------------------------- */

static M *sort_m;
static int cmp_sub(const void *x, const void *y) {
    M *m = sort_m;
    int s = *(const int *)x, t = *(const int *)y;
    int a[5] = {m->sm[s], m->sro[s], m->snr[s], m->sco[s], m->snc[s]};
    int b[5] = {m->sm[t], m->sro[t], m->snr[t], m->sco[t], m->snc[t]};
    for (int k = 0; k < 5; k++)
        if (a[k] != b[k]) return (a[k] > b[k]) - (a[k] < b[k]);
    return (s > t) - (s < t);
}

/* the submatrices the commands touching matrix mm refer to (_SubmatrixOrder._in_use) */
static int in_use(M *m, int mm, char *used) {
    evec *e = &m->ent[mm];
    for (Py_ssize_t i = 0; i < e->n; i++) {
        int c = e->d[i].ci;
        for (int k = 0; k < m->cacc_n[c]; k++) used[m->acc_s.d[m->cacc_at[c] + k]] = 1;
    }
    int cs[2] = {m->alloc[mm], m->dealloc[mm]};
    for (int k = 0; k < 2; k++) {
        int c = cs[k];
        if (c < 0) continue;
        PyObject *cmd = PyList_GET_ITEM(m->commands, c);
        int s = get_arg(m, cmd, c, 0);
        if (s == -3) return ERR;
        if (s >= m->ns) return FALLBACK;
        if (s >= 0) used[s] = 1;
        if (m->ct[c] == SWAP_MATRIX) {
            int s2 = get_arg(m, cmd, c, 1);
            if (s2 == -3) return ERR;
            if (s2 >= m->ns) return FALLBACK;
            if (s2 >= 0) used[s2] = 1;
        }
    }
    return OK;
}

static int order_renumbered(M *m, char *used, int first) {
    Py_ssize_t ns = m->ns, nm = m->nm;
    char *mats = calloc(nm ? nm : 1, 1);
    int *members = NULL;
    int rc = OK;
    if (!mats) { PyErr_NoMemory(); return ERR; }
    for (Py_ssize_t g = 0; g < m->keeps.n; g++) mats[m->keeps.d[g]] = 1;
    if (first && ns > 2) {
        /* the matrices of submatrices that have an equal one, the changed aside */
        int *order = malloc((ns - 1) * sizeof(int));
        if (!order) { free(mats); PyErr_NoMemory(); return ERR; }
        for (Py_ssize_t s = 1; s < ns; s++) order[s - 1] = (int)s;
        sort_m = m;
        qsort(order, ns - 1, sizeof(int), cmp_sub);
        for (Py_ssize_t i = 1; i < ns - 1; i++) {
            if (!same_extent(m, order[i - 1], order[i])) continue;
            int mm = m->sm[order[i]];
            if (mats[mm]) continue;
            mats[mm] = 2;   /* another matrix (marked, its uses added below) */
        }
        free(order);
        for (Py_ssize_t mm = 1; mm < nm; mm++)
            if (mats[mm] == 2) {
                rc = in_use(m, (int)mm, used);
                if (rc) goto out;
            }
    }
    /* members: the submatrices in use on these matrices, grouped by extent; each
     * group takes its smallest key */
    Py_ssize_t nmem = 0;
    members = malloc((ns ? ns : 1) * sizeof(int));
    if (!members) { rc = ERR; PyErr_NoMemory(); goto out; }
    for (Py_ssize_t mm = 1; mm < nm; mm++) {
        if (!mats[mm]) continue;
        ivec *o = &m->of[mm];
        for (Py_ssize_t i = 0; i < o->n; i++)
            if (used[o->d[i]]) members[nmem++] = o->d[i];
    }
    sort_m = m;
    qsort(members, nmem, sizeof(int), cmp_sub);
    for (Py_ssize_t i = 0; i < nmem;) {
        Py_ssize_t j = i + 1;
        int lo = m->key[members[i]];
        while (j < nmem && same_extent(m, members[i], members[j])) {
            if (m->key[members[j]] < lo) lo = m->key[members[j]];
            j++;
        }
        for (Py_ssize_t k = i; k < j; k++) m->key[members[k]] = lo;
        i = j;
    }
out:
    free(members);
    free(mats);
    return rc;
}

/* -- the zeroings (initialize_undefined.unnecessary_zeroings) --------------------------- */

typedef struct { int lo, hi; } span;

static int cmp_span(const void *x, const void *y) {
    const span *a = x, *b = y;
    if (a->lo != b->lo) return (a->lo > b->lo) - (a->lo < b->lo);
    return (a->hi > b->hi) - (a->hi < b->hi);
}

/* _decided_by_sweep: 1 needed, 0 not, 2 undecided, ERR */
static int decided_by_sweep(evec *ev, int nr, int nc, int is_output) {
    entry *e = ev->d;
    Py_ssize_t n = ev->n;
    if (n == 1) return is_output;
    int z = e[0].ci;
    if (!(e[0].r0 == 0 && e[0].r1 == nr && e[0].c0 == 0 && e[0].c1 == nc) || e[1].ci == z)
        return 2;
    int end = 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (e[i].a != W_ || e[i].c0 != end || e[i].r0 != 0 || e[i].r1 != nr) break;
        end = e[i].c1;
        if (end == nc) {
            if (i + 1 == n || e[i + 1].ci != e[i].ci) return 0;
            break;
        }
    }
    span *covered = malloc((2 * n + 2) * sizeof(span));
    span *spans = malloc((n + 1) * sizeof(span));
    span *tmp = malloc((2 * n + 2) * sizeof(span));
    int ncov = 0, axis = -1, result = -5;
    if (!covered || !spans || !tmp) { PyErr_NoMemory(); result = ERR; goto done; }
    Py_ssize_t i = 1;
    while (i < n) {
        int c = e[i].ci, nsp = 0, everything = 0;
        while (i < n && e[i].ci == c) {
            entry *x = &e[i++];
            int lo, hi;
            if (x->r0 == 0 && x->r1 == nr && x->c0 == 0 && x->c1 == nc) {
                if (x->a & R_) { result = 1; goto done; }
                everything = 1;
                continue;
            }
            if (x->c0 == 0 && x->c1 == nc && axis != 1) {
                axis = 0; lo = x->r0; hi = x->r1;
            } else if (x->r0 == 0 && x->r1 == nr && axis != 0) {
                axis = 1; lo = x->c0; hi = x->c1;
            } else {
                result = 2; goto done;
            }
            if (x->a & R_) {
                int inside = 0;
                for (int k = 0; k < ncov; k++)
                    if (covered[k].lo <= lo && hi <= covered[k].hi) { inside = 1; break; }
                if (!inside) { result = 1; goto done; }
            }
            spans[nsp].lo = lo; spans[nsp].hi = hi; nsp++;
        }
        if (everything) { result = 0; goto done; }
        for (int k = 0; k < nsp; k++) {
            int lo = spans[k].lo, hi = spans[k].hi, nt = 0;
            for (int q = 0; q < ncov; q++) {
                int x = covered[q].lo, y = covered[q].hi;
                if (y < lo || hi < x) {
                    tmp[nt].lo = x; tmp[nt].hi = y; nt++;
                } else {
                    if (x < lo) lo = x;
                    if (y > hi) hi = y;
                }
            }
            tmp[nt].lo = lo; tmp[nt].hi = hi; nt++;
            qsort(tmp, nt, sizeof(span), cmp_span);
            memcpy(covered, tmp, nt * sizeof(span));
            ncov = nt;
        }
        if (ncov == 1 && covered[0].lo == 0 && covered[0].hi == (axis == 0 ? nr : nc)) {
            result = 0; goto done;
        }
    }
    result = is_output;
done:
    free(covered); free(spans); free(tmp);
    return result;
}

typedef struct { int r0, r1, c0, c1; } rect;
typedef struct { rect *d; Py_ssize_t n, cap; } rvec;

static int rv_push(rvec *v, int r0, int r1, int c0, int c1) {
    if (v->n == v->cap) {
        Py_ssize_t cap = v->cap ? 2 * v->cap : 8;
        rect *d = realloc(v->d, cap * sizeof(rect));
        if (!d) return -1;
        v->d = d; v->cap = cap;
    }
    rect *r = &v->d[v->n++];
    r->r0 = r0; r->r1 = r1; r->c0 = c0; r->c1 = c1;
    return 0;
}

/* _inside: 1, 0, or ERR */
static int inside(rect p0, const entry *rects, Py_ssize_t nrects) {
    rvec pieces = {0}, rest = {0};
    int result = 0;
    if (rv_push(&pieces, p0.r0, p0.r1, p0.c0, p0.c1)) goto nomem;
    for (Py_ssize_t q = 0; q < nrects; q++) {
        const entry *Q = &rects[q];
        int q0 = Q->r0, q1 = Q->r1, d0 = Q->c0, d1 = Q->c1;
        rest.n = 0;
        for (Py_ssize_t i = 0; i < pieces.n; i++) {
            rect p = pieces.d[i];
            if (q0 >= p.r1 || p.r0 >= q1 || d0 >= p.c1 || p.c0 >= d1) {
                if (rv_push(&rest, p.r0, p.r1, p.c0, p.c1)) goto nomem;
                continue;
            }
            if (p.r0 < q0 && rv_push(&rest, p.r0, q0, p.c0, p.c1)) goto nomem;
            if (q1 < p.r1 && rv_push(&rest, q1, p.r1, p.c0, p.c1)) goto nomem;
            int lo = p.r0 > q0 ? p.r0 : q0, hi = p.r1 < q1 ? p.r1 : q1;
            if (p.c0 < d0 && rv_push(&rest, lo, hi, p.c0, d0)) goto nomem;
            if (d1 < p.c1 && rv_push(&rest, lo, hi, d1, p.c1)) goto nomem;
        }
        if (!rest.n) { result = 1; goto out; }
        rvec t = pieces; pieces = rest; rest = t;
    }
out:
    free(pieces.d); free(rest.d);
    return result;
nomem:
    free(pieces.d); free(rest.d);
    PyErr_NoMemory();
    return ERR;
}

/* _decided_by_rectangles: 1, 0, 2 undecided, ERR */
static int decided_by_rectangles(evec *ev, int nr, int nc, int is_output) {
    entry *e = ev->d;
    Py_ssize_t n = ev->n;
    if (!(e[0].r0 == 0 && e[0].r1 == nr && e[0].c0 == 0 && e[0].c1 == nc) || n < 2
            || e[1].ci == e[0].ci)
        return 2;
    /* the region reached so far: the rectangles of entries 1 .. start-1 */
    Py_ssize_t i = 1;
    while (i < n) {
        int c = e[i].ci;
        Py_ssize_t start = i;
        while (i < n && e[i].ci == c) {
            entry *x = &e[i++];
            if (x->a & R_) {
                rect r = {x->r0, x->r1, x->c0, x->c1};
                int in = inside(r, e + 1, start - 1);
                if (in < 0) return ERR;
                if (!in) return 1;
            }
        }
    }
    if (!is_output) return 0;
    rect z = {e[0].r0, e[0].r1, e[0].c0, e[0].c1};
    int in = inside(z, e + 1, n - 1);
    if (in < 0) return ERR;
    return !in;
}

static int zeroings(M *m, ivec *out) {
    for (Py_ssize_t mm = 1; mm < m->nm; mm++) {
        evec *ev = &m->ent[mm];
        if (!ev->n) continue;
        entry *e = ev->d;
        int z = e[0].ci;
        if (!is_zeroing(m, z)) continue;
        int nr = m->rows[mm], nc = m->cols[mm];
        int full = e[0].r0 == 0 && e[0].r1 == nr && e[0].c0 == 0 && e[0].c1 == nc;
        if (ev->n > 1 && full) {
            entry *x = &e[1];
            if (x->r0 == 0 && x->r1 == nr && x->c0 == 0 && x->c1 == nc && !(x->a & R_)
                    && x->ci != z && (ev->n == 2 || e[2].ci != x->ci)) {
                if (iv_push(out, z)) { PyErr_NoMemory(); return ERR; }
                continue;
            }
        }
        int needed = decided_by_sweep(ev, nr, nc, m->is_out[mm]);
        if (needed == 2) needed = decided_by_rectangles(ev, nr, nc, m->is_out[mm]);
        if (needed < 0) return ERR;
        if (needed == 2) return FALLBACK;   /* only the per-variable lists can tell */
        if (!needed && iv_push(out, z)) { PyErr_NoMemory(); return ERR; }
    }
    return OK;
}

/* -- the entry point ---------------------------------------------------------------------- */

static PyObject *int_list(const int *d, Py_ssize_t n) {
    PyObject *l = PyList_New(n);
    if (!l) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(d[i]);
        if (!v) { Py_DECREF(l); return NULL; }
        PyList_SET_ITEM(l, i, v);
    }
    return l;
}

static PyObject *results(M *m, ivec *zs) {
    /* Makes the edits the rounds decided on the computation (nothing can send it back to
     * Python any more): the moved submatrices, the commands that became kNoOperation, the
     * merged copies' arguments.  Returns (the commands without the no-ops, matrices now of
     * stride equal to their columns, the zeroing commands remove_unnecessary_zeroing drops,
     * the submatrix order key).  Every new object is made before the first edit, so an
     * error (memory) leaves the computation as it was. */
    PyObject *kept = PyList_New(0), *strides = NULL, *gone = NULL, *key = NULL, *res = NULL;
    PyObject **infos = NULL;
    ivec c = {0};
    if (!kept) return NULL;
    infos = calloc(m->ns ? m->ns : 1, sizeof(PyObject *));
    if (!infos) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t s = 1; s < m->ns; s++) {
        if (m->sm[s] == m->sm0[s] && m->sro[s] == m->sro0[s] && m->sco[s] == m->sco0[s])
            continue;
        int v[5] = {m->sm[s], m->sro[s], m->snr[s], m->sco[s], m->snc[s]};
        infos[s] = ints_tuple(subinfo_type, v, 5);
        if (!infos[s]) goto fail;
    }
    for (Py_ssize_t i = 0; i < m->n; i++)
        if (m->ct[i] != NO_OPERATION && PyList_Append(kept, PyList_GET_ITEM(m->commands, i)))
            goto fail;
    for (Py_ssize_t j = 0; j < m->nm; j++)
        if (m->stride[j] != m->stride0[j] && iv_push(&c, (int)j)) { PyErr_NoMemory(); goto fail; }
    strides = int_list(c.d, c.n);
    gone = PyList_New(zs->n);
    key = int_list(m->key, m->ns);
    if (!strides || !gone || !key) goto fail;
    for (Py_ssize_t i = 0; i < zs->n; i++) {
        PyObject *z = PyList_GET_ITEM(m->commands, zs->d[i]);
        Py_INCREF(z);
        PyList_SET_ITEM(gone, i, z);
    }
    res = PyTuple_Pack(4, kept, strides, gone, key);
    if (!res) goto fail;
    /* the edits */
    for (Py_ssize_t s = 1; s < m->ns; s++)
        if (infos[s]) {
            PyList_SetItem(m->subs, s, infos[s]);   /* (steals the reference) */
            infos[s] = NULL;
        }
    for (Py_ssize_t i = 0; i < m->n; i++) {
        PyObject *cmd = PyList_GET_ITEM(m->commands, i);
        if (m->ct[i] != m->ct0[i] && store_attr(cmd, 0, Py_NewRef(no_op_obj))) goto fail_after;
        if (m->cleared[i] && (store_attr(cmd, 2, PyLong_FromLong(-1))
                              || store_attr(cmd, 3, PyLong_FromLong(-1))))
            goto fail_after;
    }
    goto fail;   /* (releases the references either way) */
fail_after:
    Py_CLEAR(res);
fail:
    if (infos) for (Py_ssize_t s = 0; s < m->ns; s++) Py_XDECREF(infos[s]);
    free(infos); free(c.d);
    Py_XDECREF(kept); Py_XDECREF(strides); Py_XDECREF(gone); Py_XDECREF(key);
    return res;
}

static PyObject *run(M *m, PyObject *commands, PyObject *subs, PyObject *mats, int *status) {
    int rc = m_read(m, commands, subs, mats);
    if (rc) { *status = rc; return NULL; }
    rc = m_analyze(m);
    if (rc) { *status = rc; return NULL; }
    ivec cands = {0}, next = {0}, touched_list = {0}, zs = {0};
    char *used = NULL, *touched = NULL;
    PyObject *res = NULL;
    used = calloc(m->ns ? m->ns : 1, 1);
    touched = calloc(m->n ? m->n : 1, 1);
    if (!used || !touched) { PyErr_NoMemory(); rc = ERR; goto out; }
    for (Py_ssize_t c = 0; c < m->n; c++) {
        int s1, s2;
        int r = candidate_args(m, c, &s1, &s2);
        if (r < 0) { rc = r == -2 ? ERR : FALLBACK; goto out; }
        if (r) {
            m->is_cand[c] = 1;
            if (iv_push(&cands, (int)c)) { PyErr_NoMemory(); rc = ERR; goto out; }
        }
    }
    if (m->bad) { rc = FALLBACK; goto out; }
    if (!cands.n) { rc = OK; res = Py_NewRef(Py_False); goto out; }
    int first_round = 1;
    for (;;) {
        int merged;
        m->by_number = first_round && m->by_number;
        rc = merge_round(m, &cands, &merged);
        if (rc) goto out;
        if (!merged) { round_reset(m); break; }
        memset(used, 0, m->ns);
        for (Py_ssize_t i = 0; i < touched_list.n; i++) touched[touched_list.d[i]] = 0;
        touched_list.n = 0;
        rc = reanalyze(m, used, touched, &touched_list);
        if (rc) goto out;
        int first = m->key == NULL;
        if (first) {
            m->key = malloc((m->ns ? m->ns : 1) * sizeof(int));
            if (!m->key) { PyErr_NoMemory(); rc = ERR; goto out; }
            for (Py_ssize_t s = 0; s < m->ns; s++) m->key[s] = (int)s;
        }
        rc = order_renumbered(m, used, first);
        if (rc) goto out;
        round_reset(m);
        first_round = 0;
        m->by_number = 0;
        next.n = 0;
        for (Py_ssize_t i = 0; i < touched_list.n; i++) {
            int c = touched_list.d[i];
            if (m->is_cand[c] && !m->is_settled[c] && iv_push(&next, c)) {
                PyErr_NoMemory(); rc = ERR; goto out;
            }
        }
        if (!next.n) break;
        ivec t = cands; cands = next; next = t;
    }
    if (m->bad) { rc = FALLBACK; goto out; }
    if (m->key == NULL) { rc = OK; res = Py_NewRef(Py_False); goto out; }
    rc = zeroings(m, &zs);
    if (rc) goto out;
    res = results(m, &zs);
    if (!res) rc = ERR;
out:
    free(cands.d); free(next.d); free(touched_list.d); free(zs.d);
    free(used); free(touched);
    *status = rc;
    return res;
}

static PyObject *py_merge(PyObject *self, PyObject *args) {
    PyObject *commands, *subs, *mats, *props, *accesses_of;
    int opts[5], by_number;
    if (!PyArg_ParseTuple(args, "O!O!O!OO(ppppp)p", &PyList_Type, &commands, &PyList_Type,
                          &subs, &PyList_Type, &mats, &props, &accesses_of, &opts[0],
                          &opts[1], &opts[2], &opts[3], &opts[4], &by_number))
        return NULL;
    if (!configured || !no_op_obj || !subinfo_type) {
        PyErr_SetString(PyExc_RuntimeError,
                        "_native.configure() and configure_renumber() were not called");
        return NULL;
    }
    M m;
    memset(&m, 0, sizeof(m));
    m.commands = commands; m.subs = subs; m.props = props; m.accesses_of = accesses_of;
    m.remove_assignments = opts[0]; m.propagate_in_place = opts[1];
    m.backprop_in_place = opts[2]; m.allow_left = opts[3]; m.allow_right = opts[4];
    m.by_number = (char)by_number;
    int status = OK;
    PyObject *res = run(&m, commands, subs, mats, &status);
    m_free(&m);
    if (status == ERR) { Py_XDECREF(res); return NULL; }
    if (status == FALLBACK) { Py_XDECREF(res); Py_RETURN_NONE; }
    return res;
}

static PyObject *py_configure(PyObject *self, PyObject *args) {
    PyObject *plans, *no_op;
    long p[4];
    if (!PyArg_ParseTuple(args, "O!(llll)O", &PyTuple_Type, &plans, &p[0], &p[1], &p[2], &p[3],
                          &no_op))
        return NULL;
    if (PyLong_AsLong(no_op) != NO_OPERATION) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "not kNoOperation");
        return NULL;
    }
    Py_INCREF(no_op);
    Py_XSETREF(no_op_obj, no_op);
    if (PyTuple_GET_SIZE(plans) != NUM_TYPES) {
        PyErr_SetString(PyExc_ValueError, "one plan per command type expected");
        return NULL;
    }
    for (int t = 0; t < NUM_TYPES; t++) {
        PyObject *pl = PyTuple_GET_ITEM(plans, t);
        int kind, n = 0;
        PyObject *slots;
        if (!PyArg_ParseTuple(pl, "iO!", &kind, &PyTuple_Type, &slots)) return NULL;
        if (kind == 1) {
            n = (int)PyTuple_GET_SIZE(slots);
            if (n > MAX_SLOTS) {
                PyErr_SetString(PyExc_ValueError, "too many slots");
                return NULL;
            }
            for (int k = 0; k < n; k++)
                if (!PyArg_ParseTuple(PyTuple_GET_ITEM(slots, k), "iii", &plan_arg[t][k],
                                      &plan_acc[t][k], &plan_rule[t][k]))
                    return NULL;
        }
        plan_kind[t] = kind;
        plan_n[t] = n;
    }
    prop_propagate_in_place = p[0]; prop_backprop_in_place = p[1];
    prop_propagate_adds = p[2]; prop_backprop_adds = p[3];
    configured = 1;
    Py_RETURN_NONE;
}

/* -- ConvertAdditionToAssignment (passes/convert_addition.py) -------------------------- */

/* per command type (configure_convert): whether it touches submatrices, its submatrix
 * slots, the written one (-1), its indexes_multi slot (-1), its copy form (-1) and
 * whether the indexes_multi submatrices are written */
#define ADD_TO_ROWS_MULTI 14
static int ca_kind[NUM_TYPES], ca_n[NUM_TYPES], ca_slot[NUM_TYPES][MAX_SLOTS];
static int ca_written[NUM_TYPES], ca_multi[NUM_TYPES], ca_copy[NUM_TYPES];
static int ca_multi_written[NUM_TYPES];
static int ca_configured = 0;

typedef struct {
    rvec *rects;             /* per matrix: the distinct rectangles touched so far */
    rect *box;               /* per matrix: their bounding box */
    int *info;               /* per submatrix: m, r0, r1, c0, c1 (m = 0: not read yet) */
    Py_ssize_t ns, nm;
    PyObject *subs;
} Touched;

static int t_info(Touched *t, int s) {
    /* the extent of submatrix s, read once; 1 when it is not a valid one */
    int *x = &t->info[5 * s];
    if (x[0]) return 0;
    long v[5];
    int rc = read_ints(PyList_GET_ITEM(t->subs, s), 5, 1, v);
    if (rc == ERR) PyErr_Clear();
    if (rc || v[0] <= 0 || v[0] >= t->nm) return 1;
    x[0] = (int)v[0]; x[1] = (int)v[1]; x[2] = (int)(v[1] + v[2]);
    x[3] = (int)v[3]; x[4] = (int)(v[3] + v[4]);
    return 0;
}

static int t_untouched(Touched *t, int s) {
    int *x = &t->info[5 * s];
    rvec *rs = &t->rects[x[0]];
    if (!rs->n) return 1;
    rect *b = &t->box[x[0]];
    if (!(b->r0 < x[2] && x[1] < b->r1 && b->c0 < x[4] && x[3] < b->c1)) return 1;
    for (Py_ssize_t i = 0; i < rs->n; i++) {
        rect *r = &rs->d[i];
        if (r->r0 < x[2] && x[1] < r->r1 && r->c0 < x[4] && x[3] < r->c1) return 0;
    }
    return 1;
}

static int t_add(Touched *t, int s) {
    int *x = &t->info[5 * s];
    rvec *rs = &t->rects[x[0]];
    rect *b = &t->box[x[0]];
    if (!rs->n) {
        b->r0 = x[1]; b->r1 = x[2]; b->c0 = x[3]; b->c1 = x[4];
    } else {
        /* the same rectangle again adds nothing (the usual repeat: the last one) */
        rect *l = &rs->d[rs->n - 1];
        if (l->r0 == x[1] && l->r1 == x[2] && l->c0 == x[3] && l->c1 == x[4]) return 0;
        if (x[1] < b->r0) b->r0 = x[1];
        if (x[2] > b->r1) b->r1 = x[2];
        if (x[3] < b->c0) b->c0 = x[3];
        if (x[4] > b->c1) b->c1 = x[4];
    }
    return rv_push(rs, x[1], x[2], x[3], x[4]);
}

/* the distinct positive submatrices of indexes_multi[k], increasing (cached) */
static int multi_subs(PyObject *table, Py_ssize_t k, ivec *cache, char *cached, Touched *t) {
    if (cached[k]) return 0;
    if (k < 0 || k >= PyList_GET_SIZE(table)) return 1;
    PyObject *lst = PyList_GET_ITEM(table, k);
    PyObject *fast = PySequence_Fast(lst, "indexes_multi entry");
    if (!fast) { PyErr_Clear(); return 1; }
    ivec *v = &cache[k];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *first = PySequence_GetItem(pair, 0);
        if (!first) { PyErr_Clear(); Py_DECREF(fast); return 1; }
        long sv = PyLong_AsLong(first);
        Py_DECREF(first);
        if (sv == -1 && PyErr_Occurred()) { PyErr_Clear(); Py_DECREF(fast); return 1; }
        if (sv <= 0) continue;
        if (sv >= t->ns || t_info(t, (int)sv)) { Py_DECREF(fast); return 1; }
        if (iv_push(v, (int)sv)) { Py_DECREF(fast); return -1; }
    }
    Py_DECREF(fast);
    qsort(v->d, v->n, sizeof(int), cmp_int);
    Py_ssize_t w = 0;
    for (Py_ssize_t i = 0; i < v->n; i++)
        if (!w || v->d[w - 1] != v->d[i]) v->d[w++] = v->d[i];
    v->n = w;
    cached[k] = 1;
    return 0;
}

static long read_long_attr(PyObject *o, PyObject *name, int *err) {
    return as_long(cmd_attr(o, name), err);
}

static PyObject *py_convert_addition(PyObject *self, PyObject *args) {
    PyObject *commands, *subs, *table;
    Py_ssize_t nm;
    if (!PyArg_ParseTuple(args, "O!O!nO!", &PyList_Type, &commands, &PyList_Type, &subs, &nm,
                          &PyList_Type, &table))
        return NULL;
    if (!ca_configured) {
        PyErr_SetString(PyExc_RuntimeError, "_native.configure_convert() was not called");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(commands), ns = PyList_GET_SIZE(subs);
    Py_ssize_t nt = PyList_GET_SIZE(table);
    Touched t = {0};
    t.ns = ns; t.nm = nm; t.subs = subs;
    t.rects = calloc(nm ? nm : 1, sizeof(rvec));
    t.box = calloc(nm ? nm : 1, sizeof(rect));
    t.info = calloc(ns ? 5 * ns : 1, sizeof(int));
    ivec *mcache = calloc(nt ? nt : 1, sizeof(ivec));
    char *mcached = calloc(nt ? nt : 1, 1);
    ivec out = {0};
    PyObject *res = NULL;
    int fallback = 0;
    if (!t.rects || !t.box || !t.info || !mcache || !mcached) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *cmd = PyList_GET_ITEM(commands, c);
        int err = 0;
        long ct = read_long_attr(cmd, s_type, &err);
        if (err) goto done;
        if (ct < 0 || ct >= NUM_TYPES) { fallback = 1; goto done; }
        if (!ca_kind[ct]) continue;
        double alpha = 1.0;
        if (ct == SET_CONST || ct == ADD_TO_ROWS_MULTI) {
            if (cmd_alpha(cmd, &alpha)) goto done;
            if (ct == SET_CONST && alpha == 0.0) continue;   /* a zeroing does not count */
        }
        ivec *multi = NULL;
        if (ca_multi[ct] >= 0) {
            long k = read_long_attr(cmd, s_args[ca_multi[ct]], &err);
            if (err) goto done;
            int r = multi_subs(table, k, mcache, mcached, &t);
            if (r < 0) { PyErr_NoMemory(); goto done; }
            if (r) { fallback = 1; goto done; }
            multi = &mcache[k];
        }
        /* the submatrix slots, read and checked once */
        int sl[MAX_SLOTS];
        for (int k = 0; k < ca_n[ct]; k++) {
            long v = read_long_attr(cmd, s_args[ca_slot[ct][k]], &err);
            if (err) goto done;
            if (v > 0 && (v >= ns || t_info(&t, (int)v))) { fallback = 1; goto done; }
            if (v < -1) { fallback = 1; goto done; }
            sl[k] = (int)v;
        }
        if (ca_copy[ct] >= 0 && (ct != ADD_TO_ROWS_MULTI || alpha == 1.0)) {
            int first = 1;
            if (ca_written[ct] >= 0) {
                int sw = sl[ca_written[ct]];
                if (sw > 0) first = t_untouched(&t, sw);
            }
            if (first && ca_multi_written[ct] && multi)
                for (Py_ssize_t i = 0; i < multi->n && first; i++)
                    first = t_untouched(&t, multi->d[i]);
            if (first && iv_push(&out, (int)c)) { PyErr_NoMemory(); goto done; }
        }
        for (int k = 0; k < ca_n[ct]; k++)
            if (sl[k] > 0 && t_add(&t, sl[k])) { PyErr_NoMemory(); goto done; }
        if (multi)
            for (Py_ssize_t i = 0; i < multi->n; i++)
                if (t_add(&t, multi->d[i])) { PyErr_NoMemory(); goto done; }
    }
    res = int_list(out.d, out.n);
done:
    if (t.rects) for (Py_ssize_t i = 0; i < nm; i++) free(t.rects[i].d);
    if (mcache) for (Py_ssize_t i = 0; i < nt; i++) free(mcache[i].d);
    free(t.rects); free(t.box); free(t.info); free(mcache); free(mcached); free(out.d);
    if (fallback && !res && !PyErr_Occurred()) Py_RETURN_NONE;
    return res;
}

static PyObject *py_configure_convert(PyObject *self, PyObject *args) {
    PyObject *plans;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &plans)) return NULL;
    if (PyTuple_GET_SIZE(plans) != NUM_TYPES) {
        PyErr_SetString(PyExc_ValueError, "one plan per command type expected");
        return NULL;
    }
    for (int t = 0; t < NUM_TYPES; t++) {
        PyObject *pl = PyTuple_GET_ITEM(plans, t), *slots;
        int kind, written, multi, copy, multi_written;
        if (!PyArg_ParseTuple(pl, "iO!iiip", &kind, &PyTuple_Type, &slots, &written, &multi,
                              &copy, &multi_written))
            return NULL;
        int n = (int)PyTuple_GET_SIZE(slots);
        if (n > MAX_SLOTS || written >= n || multi >= 7 || copy >= NUM_TYPES) {
            PyErr_SetString(PyExc_ValueError, "bad convert plan");
            return NULL;
        }
        for (int k = 0; k < n; k++) {
            long v = PyLong_AsLong(PyTuple_GET_ITEM(slots, k));
            if (v < 0 || v >= 7) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad slot");
                return NULL;
            }
            ca_slot[t][k] = (int)v;
        }
        ca_kind[t] = kind; ca_n[t] = n; ca_written[t] = written; ca_multi[t] = multi;
        ca_copy[t] = copy; ca_multi_written[t] = multi_written;
    }
    ca_configured = 1;
    Py_RETURN_NONE;
}

/* -- ExtendMatrices (passes/extend_matrices.py) ----------------------------------------- */

typedef struct { int m, ro, nr, co, nc; } subx;
typedef struct { subx *d; Py_ssize_t n, cap; } svec;

static int sv_push(svec *v, int m, int ro, int nr, int co, int nc) {
    if (v->n == v->cap) {
        Py_ssize_t cap = v->cap ? 2 * v->cap : 64;
        subx *d = realloc(v->d, cap * sizeof(subx));
        if (!d) return -1;
        v->d = d; v->cap = cap;
    }
    subx *x = &v->d[v->n++];
    x->m = m; x->ro = ro; x->nr = nr; x->co = co; x->nc = nc;
    return 0;
}

/* extend_matrices(commands, submatrices, matrices, min_proportion): None (leave it to
 * Python), or (new submatrices to append as (m, ro, nr, co, nc), matrices that grew as
 * (m, rows before, rows now), copies pointed at new submatrices as (c, arg1, arg2),
 * other commands whose arg1 changes as (c, arg1)); all lists empty when nothing grows */
static PyObject *py_extend_matrices(PyObject *self, PyObject *args) {
    PyObject *commands, *subs, *mats;
    double min_prop;
    if (!PyArg_ParseTuple(args, "O!O!O!d", &PyList_Type, &commands, &PyList_Type, &subs,
                          &PyList_Type, &mats, &min_prop))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(commands), ns0 = PyList_GET_SIZE(subs);
    Py_ssize_t nm = PyList_GET_SIZE(mats);
    int *rows = calloc(nm ? nm : 1, sizeof(int)), *cols = calloc(nm ? nm : 1, sizeof(int));
    int *rows0 = calloc(nm ? nm : 1, sizeof(int)), *io = calloc(nm ? nm : 1, sizeof(int));
    int *ct = calloc(n ? n : 1, sizeof(int)), *a1 = calloc(n ? n : 1, sizeof(int));
    int *a2 = calloc(n ? n : 1, sizeof(int));
    char *grown = calloc(nm ? nm : 1, 1), *alpha1 = calloc(n ? n : 1, 1);
    char *zeroing = calloc(n ? n : 1, 1);
    svec sv = {0};
    ivec copies = {0}, grown_list = {0}, edits = {0};
    int *whole = NULL;
    PyObject *res = NULL;
    int fallback = 0, err = 0;
    if (!rows || !cols || !rows0 || !io || !ct || !a1 || !a2 || !grown || !alpha1 || !zeroing) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < nm; j++) {
        long v[2];
        int rc = read_ints(PyList_GET_ITEM(mats, j), 2, 0, v);
        if (rc == ERR) goto done;
        if (rc) { fallback = 1; goto done; }
        rows[j] = rows0[j] = (int)v[0];
        cols[j] = (int)v[1];
    }
    for (Py_ssize_t s = 0; s < ns0; s++) {
        long v[5];
        int rc = read_ints(PyList_GET_ITEM(subs, s), 5, 1, v);
        if (rc == ERR) goto done;
        if (rc || v[0] < 0 || v[0] >= nm) { fallback = 1; goto done; }
        if (sv_push(&sv, (int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4])) {
            PyErr_NoMemory(); goto done;
        }
    }
    /* the command types; the copies (alpha 1) and io commands' arguments */
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *cmd = PyList_GET_ITEM(commands, c);
        long t = read_long_attr(cmd, s_type, &err);
        if (err) goto done;
        ct[c] = (int)t;
        if (t == SWAP_MATRIX) { fallback = 1; goto done; }   /* Python reports it */
        if (t == MATRIX_COPY || t == SET_CONST) {
            double al;
            if (cmd_alpha(cmd, &al)) goto done;
            alpha1[c] = al == 1.0;
            zeroing[c] = t == SET_CONST && al == 0.0;
        }
        if (t == MATRIX_COPY || t == ACCEPT_INPUT || t == PROVIDE_OUTPUT || t == ALLOC_MATRIX
                || t == DEALLOC_MATRIX || zeroing[c]) {
            long v = read_long_attr(cmd, s_args[0], &err);
            if (err) goto done;
            if (v < 0 || v >= ns0) { fallback = 1; goto done; }
            a1[c] = (int)v;
            if (t == MATRIX_COPY) {
                v = read_long_attr(cmd, s_args[1], &err);
                if (err) goto done;
                if (v < 0 || v >= ns0) { fallback = 1; goto done; }
                a2[c] = (int)v;
            }
        }
    }
    int io_known = 0;
    for (Py_ssize_t c = 0; c < n; c++) {
        if (ct[c] != MATRIX_COPY || !alpha1[c]) continue;
        subx src = sv.d[a2[c]], dst = sv.d[a1[c]];
        int sm = src.m, dm = dst.m;
        int src_rows = rows[sm];
        int src_orig = grown[sm] ? rows0[sm] : rows[sm];
        int dst_orig = grown[dm] ? rows0[dm] : rows[dm];
        if (sm == dm || src.ro != 0 || src.co != 0 || src.nc != cols[sm] || src.nr >= src_rows
                || (double)src.nr < min_prop * (double)src_orig || dst.ro + dst.nr != dst_orig)
            continue;
        if (!io_known) {
            for (Py_ssize_t k = 0; k < n; k++)
                if (ct[k] == ACCEPT_INPUT || ct[k] == PROVIDE_OUTPUT) io[sv.d[a1[k]].m] = 1;
            io_known = 1;
        }
        if (io[dm]) continue;
        int new_rows = dst.ro + src_rows;
        if (new_rows > rows[dm]) {
            if (!grown[dm]) {
                grown[dm] = 1;
                rows0[dm] = rows[dm];
                if (iv_push(&grown_list, dm)) { PyErr_NoMemory(); goto done; }
            }
            rows[dm] = new_rows;
            if (sv_push(&sv, dm, 0, new_rows, 0, cols[dm])) { PyErr_NoMemory(); goto done; }
        }
        if (sv_push(&sv, dst.m, dst.ro, src_rows, dst.co, dst.nc)) { PyErr_NoMemory(); goto done; }
        a1[c] = (int)sv.n - 1;
        if (sv_push(&sv, sm, 0, src_rows, 0, cols[sm])) { PyErr_NoMemory(); goto done; }
        a2[c] = (int)sv.n - 1;
        if (iv_push(&copies, (int)c)) { PyErr_NoMemory(); goto done; }
    }
    if (copies.n) {
        /* FixComputation: allocations, deallocations and zeroings of a whole matrix (as
         * it was) on the last submatrix covering the matrix now */
        whole = calloc(nm ? nm : 1, sizeof(int));
        if (!whole) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t s = 1; s < sv.n; s++) {
            subx x = sv.d[s];
            if (x.ro == 0 && x.co == 0 && x.nr == rows[x.m] && x.nc == cols[x.m]) whole[x.m] = (int)s;
        }
        for (Py_ssize_t j = 1; j < nm; j++)
            if (!whole[j]) { fallback = 1; goto done; }   /* Python names the matrix */
        for (Py_ssize_t c = 0; c < n; c++) {
            int t = ct[c], to = -1;
            if (t == ALLOC_MATRIX || t == DEALLOC_MATRIX) {
                to = whole[sv.d[a1[c]].m];
            } else if (zeroing[c]) {
                subx x = sv.d[a1[c]];
                int orig = grown[x.m] ? rows0[x.m] : rows[x.m];
                if (x.ro == 0 && x.co == 0 && x.nc == cols[x.m] && x.nr == orig) to = whole[x.m];
            }
            if (to >= 0 && to != a1[c]) {
                if (iv_push(&edits, (int)c) || iv_push(&edits, to)) { PyErr_NoMemory(); goto done; }
            }
        }
    }
    {
        PyObject *new_subs = PyList_New(sv.n - ns0), *gl = PyList_New(grown_list.n);
        PyObject *cl = PyList_New(copies.n), *el = PyList_New(edits.n / 2);
        if (!new_subs || !gl || !cl || !el) goto build_fail;
        for (Py_ssize_t s = ns0; s < sv.n; s++) {
            int v[5] = {sv.d[s].m, sv.d[s].ro, sv.d[s].nr, sv.d[s].co, sv.d[s].nc};
            PyObject *t = ints_tuple(NULL, v, 5);
            if (!t) goto build_fail;
            PyList_SET_ITEM(new_subs, s - ns0, t);
        }
        for (Py_ssize_t i = 0; i < grown_list.n; i++) {
            int m = grown_list.d[i];
            int v[3] = {m, rows0[m], rows[m]};
            PyObject *t = ints_tuple(NULL, v, 3);
            if (!t) goto build_fail;
            PyList_SET_ITEM(gl, i, t);
        }
        for (Py_ssize_t i = 0; i < copies.n; i++) {
            int c = copies.d[i];
            int v[3] = {c, a1[c], a2[c]};
            PyObject *t = ints_tuple(NULL, v, 3);
            if (!t) goto build_fail;
            PyList_SET_ITEM(cl, i, t);
        }
        for (Py_ssize_t i = 0; i < edits.n / 2; i++) {
            PyObject *t = ints_tuple(NULL, &edits.d[2 * i], 2);
            if (!t) goto build_fail;
            PyList_SET_ITEM(el, i, t);
        }
        res = PyTuple_Pack(4, new_subs, gl, cl, el);
build_fail:
        Py_XDECREF(new_subs); Py_XDECREF(gl); Py_XDECREF(cl); Py_XDECREF(el);
    }
done:
    free(rows); free(cols); free(rows0); free(io); free(ct); free(a1); free(a2); free(grown);
    free(alpha1); free(zeroing); free(sv.d); free(copies.d); free(grown_list.d); free(edits.d);
    free(whole);
    if (fallback && !PyErr_Occurred()) { Py_XDECREF(res); Py_RETURN_NONE; }
    return res;
}

/* -- MoveSizingCommands (passes/move_sizing_commands.py) -------------------------------- */

#define GOTO_LABEL 24

typedef struct { long key; int index; } keyed;

static int cmp_keyed(const void *x, const void *y) {
    const keyed *a = x, *b = y;
    if (a->key != b->key) return (a->key > b->key) - (a->key < b->key);
    return (a->index > b->index) - (a->index < b->index);
}

/* the matrix of submatrix s (read once into mcache; -1 when s is not a valid one) */
static int sub_matrix(PyObject *subs, Py_ssize_t nm, int s, int *mcache) {
    if (s <= 0 || s >= PyList_GET_SIZE(subs)) return -1;
    if (mcache[s] != -2) return mcache[s];
    long v[5];
    int rc = read_ints(PyList_GET_ITEM(subs, s), 5, 1, v);
    if (rc == ERR) PyErr_Clear();
    if (rc) return -1;
    mcache[s] = (v[0] > 0 && v[0] < nm) ? (int)v[0] : -1;
    return mcache[s];
}

/* command i accesses matrix m (-1: not a valid submatrix's, 1 returned): the first,
 * second and last commands to access each matrix */
static int accessed(int m, int i, int *first, int *second, int *last) {
    if (m < 0) return 1;
    if (first[m] == -1) first[m] = i;
    else if (first[m] != i && second[m] == -1) second[m] = i;
    last[m] = i;
    return 0;
}

/* move_sizing_commands(commands, submatrices, num_matrices, indexes_multi): the commands
 * in their new order (a new list) and whether it differs, or None */
static PyObject *py_move_sizing(PyObject *self, PyObject *args) {
    PyObject *commands, *subs, *table;
    Py_ssize_t nm;
    if (!PyArg_ParseTuple(args, "O!O!nO!", &PyList_Type, &commands, &PyList_Type, &subs, &nm,
                          &PyList_Type, &table))
        return NULL;
    if (!ca_configured) {
        PyErr_SetString(PyExc_RuntimeError, "_native.configure_convert() was not called");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(commands), ns = PyList_GET_SIZE(subs);
    Py_ssize_t nt = PyList_GET_SIZE(table);
    int *alloc_at = malloc((nm ? nm : 1) * sizeof(int)), *dealloc_at = malloc((nm ? nm : 1) * sizeof(int));
    int *first = malloc((nm ? nm : 1) * sizeof(int)), *second = malloc((nm ? nm : 1) * sizeof(int));
    int *last = malloc((nm ? nm : 1) * sizeof(int)), *mcache = malloc((ns ? ns : 1) * sizeof(int));
    keyed *key = malloc((n ? n : 1) * sizeof(keyed));
    /* per command: is a zeroing (SET_CONST, alpha 0), and its arg1 (allocations too) */
    char *zero = calloc(n ? n : 1, 1);
    int *arg1 = malloc((n ? n : 1) * sizeof(int));
    ivec *mc = calloc(nt ? nt : 1, sizeof(ivec));
    char *mcached = calloc(nt ? nt : 1, 1);
    Touched t = {0};
    PyObject *res = NULL;
    int fallback = 0, err = 0;
    t.ns = ns; t.nm = nm; t.subs = subs;
    t.info = calloc(ns ? 5 * ns : 1, sizeof(int));
    if (!alloc_at || !dealloc_at || !first || !second || !last || !mcache || !key || !zero
            || !arg1 || !mc || !mcached || !t.info) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < nm; j++)
        alloc_at[j] = dealloc_at[j] = first[j] = second[j] = last[j] = -1;
    for (Py_ssize_t s = 0; s < ns; s++) mcache[s] = -2;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cmd = PyList_GET_ITEM(commands, i);
        long ct = read_long_attr(cmd, s_type, &err);
        if (err) goto done;
        if (ct < 0 || ct >= NUM_TYPES) { fallback = 1; goto done; }
        arg1[i] = -1;
        if (ct == ALLOC_MATRIX || ct == DEALLOC_MATRIX) {
            long s = read_long_attr(cmd, s_args[0], &err);
            if (err) goto done;
            int m = (s > 0 && s < ns) ? sub_matrix(subs, nm, (int)s, mcache) : -1;
            if (m < 0) { fallback = 1; goto done; }
            arg1[i] = (int)s;
            if (ct == ALLOC_MATRIX) alloc_at[m] = (int)i; else dealloc_at[m] = (int)i;
            continue;
        }
        if (!ca_kind[ct]) {
            if (ct == GOTO_LABEL) { fallback = 1; goto done; }   /* Python reports it */
            continue;
        }
        if (ct == SET_CONST) {
            double al;
            if (cmd_alpha(cmd, &al)) goto done;
            zero[i] = al == 0.0;
        }
        for (int k = 0; k < ca_n[ct]; k++) {
            long s = read_long_attr(cmd, s_args[ca_slot[ct][k]], &err);
            if (err) goto done;
            if (k == 0) arg1[i] = (int)(s < -1 || s > 0x7fffffff ? -1 : s);
            if (s <= 0) continue;
            if (s >= ns || accessed(sub_matrix(subs, nm, (int)s, mcache), (int)i, first, second,
                                    last)) {
                fallback = 1; goto done;
            }
        }
        if (ca_multi[ct] >= 0) {
            long kk = read_long_attr(cmd, s_args[ca_multi[ct]], &err);
            if (err) goto done;
            int r = multi_subs(table, kk, mc, mcached, &t);
            if (r < 0) { PyErr_NoMemory(); goto done; }
            if (r) { fallback = 1; goto done; }
            for (Py_ssize_t q = 0; q < mc[kk].n; q++)
                if (accessed(sub_matrix(subs, nm, mc[kk].d[q], mcache), (int)i, first, second,
                             last)) {
                    fallback = 1; goto done;
                }
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) { key[i].key = 3 * (long)i; key[i].index = (int)i; }
    for (Py_ssize_t m = 1; m < nm; m++) {
        int f = first[m];
        if (f == -1) continue;
        int alloc = alloc_at[m];
        if (alloc != -1) {
            if (f == alloc + 1 && zero[f] && arg1[f] == arg1[alloc]) {
                f = second[m];
                if (f != -1) key[alloc + 1].key = 3 * (long)f - 1;
            }
            if (f != -1) {
                if (f <= alloc) { fallback = 1; goto done; }   /* Python reports it */
                key[alloc].key = 3 * (long)f - 1;
            }
        }
        if (dealloc_at[m] != -1) key[dealloc_at[m]].key = 3 * (long)last[m] + 1;
    }
    qsort(key, n, sizeof(keyed), cmp_keyed);
    {
        PyObject *lst = PyList_New(n);
        if (!lst) goto done;
        int changed = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *c = PyList_GET_ITEM(commands, key[i].index);
            Py_INCREF(c);
            PyList_SET_ITEM(lst, i, c);
            if (key[i].index != i) changed = 1;
        }
        res = Py_BuildValue("(NO)", lst, changed ? Py_True : Py_False);
    }
done:
    free(alloc_at); free(dealloc_at); free(first); free(second); free(last); free(mcache);
    free(key); free(zero); free(arg1); free(mcached); free(t.info);
    if (mc) for (Py_ssize_t i = 0; i < nt; i++) free(mc[i].d);
    free(mc);
    if (fallback && !PyErr_Occurred()) { Py_XDECREF(res); Py_RETURN_NONE; }
    return res;
}

/* -- RemoveUnnecessaryAllocation (passes/allocate_from_other.py) ------------------------- */

typedef struct { int rows, cols, index, is_alloc; } sized;

static int cmp_sized(const void *x, const void *y) {
    const sized *a = x, *b = y;
    if (a->rows != b->rows) return (a->rows > b->rows) - (a->rows < b->rows);
    if (a->cols != b->cols) return (a->cols > b->cols) - (a->cols < b->cols);
    return (a->index > b->index) - (a->index < b->index);
}

static int next_free(int *parent, int k) {
    /* the first position >= k still free (parent[k] == k when free; path halving) */
    while (parent[k] != k) {
        parent[k] = parent[parent[k]];
        k = parent[k];
    }
    return k;
}

/* allocation_pairs(commands, submatrices, matrices, default_stride): the (deallocation,
 * allocation) pairs that become one kSwapMatrix, or None */
static PyObject *py_allocation_pairs(PyObject *self, PyObject *args) {
    PyObject *commands, *subs, *mats;
    long default_stride;
    if (!PyArg_ParseTuple(args, "O!O!O!l", &PyList_Type, &commands, &PyList_Type, &subs,
                          &PyList_Type, &mats, &default_stride))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(commands), ns = PyList_GET_SIZE(subs);
    Py_ssize_t nm = PyList_GET_SIZE(mats);
    int *mrows = malloc((nm ? nm : 1) * sizeof(int)), *mcols = malloc((nm ? nm : 1) * sizeof(int));
    int *mcache = malloc((ns ? ns : 1) * sizeof(int));
    sized *items = malloc((n ? n : 1) * sizeof(sized));
    int *allocs = malloc((n ? n : 1) * sizeof(int)), *parent = malloc((n + 1) * sizeof(int));
    ivec pairs = {0};
    PyObject *res = NULL;
    int fallback = 0, err = 0;
    Py_ssize_t k = 0;
    if (!mrows || !mcols || !mcache || !items || !allocs || !parent) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t j = 0; j < nm; j++) {
        PyObject *mi = PyList_GET_ITEM(mats, j);
        if (!PyTuple_Check(mi) || PyTuple_GET_SIZE(mi) < 3) { fallback = 1; goto done; }
        long r = PyLong_AsLong(PyTuple_GET_ITEM(mi, 0)), c = PyLong_AsLong(PyTuple_GET_ITEM(mi, 1));
        long st = PyLong_AsLong(PyTuple_GET_ITEM(mi, 2));
        if (PyErr_Occurred()) goto done;
        mrows[j] = (int)r;
        mcols[j] = st == default_stride ? (int)c : -(int)c;
    }
    for (Py_ssize_t s = 0; s < ns; s++) mcache[s] = -2;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cmd = PyList_GET_ITEM(commands, i);
        long ct = read_long_attr(cmd, s_type, &err);
        if (err) goto done;
        if (ct != ALLOC_MATRIX && ct != DEALLOC_MATRIX) continue;
        long s = read_long_attr(cmd, s_args[0], &err);
        if (err) goto done;
        int m = (s > 0 && s < ns) ? sub_matrix(subs, nm, (int)s, mcache) : -1;
        if (m < 0) { fallback = 1; goto done; }
        items[k].rows = mrows[m]; items[k].cols = mcols[m];
        items[k].index = (int)i; items[k].is_alloc = ct == ALLOC_MATRIX;
        k++;
    }
    qsort(items, k, sizeof(sized), cmp_sized);
    for (Py_ssize_t g = 0; g < k;) {
        Py_ssize_t h = g;
        while (h < k && items[h].rows == items[g].rows && items[h].cols == items[g].cols) h++;
        /* the allocations of this size (in command order) and its deallocations from the
         * last: each takes the earliest allocation after it still free */
        int na = 0;
        for (Py_ssize_t q = g; q < h; q++) if (items[q].is_alloc) allocs[na++] = items[q].index;
        for (int q = 0; q <= na; q++) parent[q] = q;   /* position na: none left */
        for (Py_ssize_t q = h - 1; q >= g; q--) {
            if (items[q].is_alloc) continue;
            int d = items[q].index;
            /* the first allocation after d (allocs increasing) */
            int lo = 0, hi = na;
            while (lo < hi) { int mid = (lo + hi) / 2; if (allocs[mid] <= d) lo = mid + 1; else hi = mid; }
            int p = next_free(parent, lo);
            if (p == na) continue;
            parent[p] = p + 1;
            if (iv_push(&pairs, d) || iv_push(&pairs, allocs[p])) { PyErr_NoMemory(); goto done; }
        }
        g = h;
    }
    res = PyList_New(pairs.n / 2);
    if (!res) goto done;
    for (Py_ssize_t i = 0; i < pairs.n / 2; i++) {
        PyObject *t = ints_tuple(NULL, &pairs.d[2 * i], 2);
        if (!t) { Py_CLEAR(res); goto done; }
        PyList_SET_ITEM(res, i, t);
    }
done:
    free(mrows); free(mcols); free(mcache); free(items); free(allocs); free(parent); free(pairs.d);
    if (fallback && !PyErr_Occurred()) { Py_XDECREF(res); Py_RETURN_NONE; }
    return res;
}

/* -- renumbering of submatrices and matrices (passes/renumber.py, renumber_with_maps) ---- */

static int rn_n[NUM_TYPES], rn_slot[NUM_TYPES][7];   /* the SUBMATRIX slots of each type */
static int rn_configured = 0;

typedef struct { int ext[5]; int pos; } extpos;

static int cmp_extpos(const void *x, const void *y) {
    const extpos *a = x, *b = y;
    for (int k = 0; k < 5; k++)
        if (a->ext[k] != b->ext[k]) return (a->ext[k] > b->ext[k]) - (a->ext[k] < b->ext[k]);
    return (a->pos > b->pos) - (a->pos < b->pos);
}

static const int *order_keys;
static int cmp_by_key(const void *x, const void *y) {
    int a = *(const int *)x, b = *(const int *)y;
    if (order_keys[a] != order_keys[b]) return (order_keys[a] > order_keys[b]) - (order_keys[a] < order_keys[b]);
    return (a > b) - (a < b);   /* stable: ties by number */
}

/* renumber_submatrices(commands, submatrices, num_matrices, indexes_multi, order_key):
 * the submatrix and matrix part of renumber_with_maps.  Drops the submatrices nothing
 * refers to (command slots, indexes_multi), merges equal ones (the first in the order
 * of order_key, or of their numbers, stands for all), drops the matrices left without
 * one, and writes the new numbers into the commands' submatrix slots.  Returns None
 * (left to the Python form: a value out of range, an entry it cannot read), or
 * (submatrices changed, matrices changed, the new submatrix list, matrix_used,
 * sub_source, old -> new submatrix numbers), the last four None when nothing changed. */
static PyObject *py_renumber_submatrices(PyObject *self, PyObject *args) {
    PyObject *commands, *subs, *table, *order;
    Py_ssize_t nm;
    if (!PyArg_ParseTuple(args, "O!O!nO!O", &PyList_Type, &commands, &PyList_Type, &subs, &nm,
                          &PyList_Type, &table, &order))
        return NULL;
    if (!rn_configured) {   /* (without configure_command every slot goes through setattr) */
        PyErr_SetString(PyExc_RuntimeError, "_native.configure_renumber() was not called");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(commands), ns = PyList_GET_SIZE(subs);
    char *refd = calloc(ns ? ns : 1, 1);
    int *ext = malloc((ns ? 5 * ns : 5) * sizeof(int));
    int *key = NULL, *kept = malloc((ns ? ns : 1) * sizeof(int));
    int *newnum = malloc((ns ? ns : 1) * sizeof(int)), *rep = malloc((ns ? ns : 1) * sizeof(int));
    int *o2n = malloc((ns ? ns : 1) * sizeof(int)), *newmat = malloc((nm + 1) * sizeof(int));
    char *mused = calloc(nm ? nm : 1, 1);
    extpos *ep = malloc((ns ? ns : 1) * sizeof(extpos));
    /* the submatrix slot values, read once: (command, slot, value) */
    ivec slots = {0};
    PyObject *res = NULL;
    int fallback = 0, err = 0;
    if (!refd || !ext || !kept || !newnum || !rep || !o2n || !newmat || !mused || !ep) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < ns; s++) {
        long v[5];
        int rc = read_ints(PyList_GET_ITEM(subs, s), 5, 1, v);
        if (rc == ERR) goto done;
        if (rc || (s && (v[0] <= 0 || v[0] >= nm))) { fallback = 1; goto done; }
        for (int k = 0; k < 5; k++) ext[5 * s + k] = (int)v[k];
    }
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *cmd = PyList_GET_ITEM(commands, c);
        long t = read_long_attr(cmd, s_type, &err);
        if (err) goto done;
        if (t < 0 || t >= NUM_TYPES) { fallback = 1; goto done; }
        for (int k = 0; k < rn_n[t]; k++) {
            long v = read_long_attr(cmd, s_args[rn_slot[t][k]], &err);
            if (err) goto done;
            if (v >= ns || v < -1) { fallback = 1; goto done; }   /* Python decides */
            if (v > 0) {
                refd[v] = 1;
                if (iv_push(&slots, (int)c) || iv_push(&slots, rn_slot[t][k])
                        || iv_push(&slots, (int)v)) {
                    PyErr_NoMemory(); goto done;
                }
            }
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(table); i++) {
        PyObject *fast = PySequence_Fast(PyList_GET_ITEM(table, i), "indexes_multi entry");
        if (!fast) { PyErr_Clear(); fallback = 1; goto done; }
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(fast); j++) {
            PyObject *pair = PySequence_Fast_GET_ITEM(fast, j);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                Py_DECREF(fast); fallback = 1; goto done;
            }
            long v = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
            if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); Py_DECREF(fast); fallback = 1; goto done; }
            if (v >= ns || v < -1) { Py_DECREF(fast); fallback = 1; goto done; }
            if (v > 0) refd[v] = 1;
        }
        Py_DECREF(fast);
    }
    Py_ssize_t nk = 0;
    for (Py_ssize_t s = 1; s < ns; s++) if (refd[s]) kept[nk++] = (int)s;
    if (order != Py_None) {
        if (!PyList_Check(order) || PyList_GET_SIZE(order) != ns) { fallback = 1; goto done; }
        key = malloc((ns ? ns : 1) * sizeof(int));
        if (!key) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t s = 0; s < ns; s++) {
            key[s] = (int)PyLong_AsLong(PyList_GET_ITEM(order, s));
        }
        if (PyErr_Occurred()) goto done;
        order_keys = key;
        qsort(kept, nk, sizeof(int), cmp_by_key);
    }
    /* each extent's first submatrix in kept order stands for it; new numbers in order
     * of first appearance */
    for (Py_ssize_t i = 0; i < nk; i++) {
        memcpy(ep[i].ext, &ext[5 * kept[i]], 5 * sizeof(int));
        ep[i].pos = (int)i;
    }
    qsort(ep, nk, sizeof(extpos), cmp_extpos);
    for (Py_ssize_t i = 0; i < nk;) {   /* rep[pos] = pos of the group's first */
        Py_ssize_t j = i;
        while (j < nk && !memcmp(ep[j].ext, ep[i].ext, 5 * sizeof(int))) rep[ep[j++].pos] = ep[i].pos;
        i = j;
    }
    int next = 1, sub_changed = 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (rep[i] == i) newnum[i] = next++;
        else newnum[i] = newnum[rep[i]];
        o2n[kept[i]] = newnum[i];
        if (newnum[i] != kept[i]) sub_changed = 1;
        mused[ext[5 * kept[i]]] = 1;
    }
    if (nm) mused[0] = 1;
    if (next != ns) sub_changed = 1;
    int nkm = 0;
    for (Py_ssize_t m = 0; m < nm; m++) { newmat[m] = nkm; nkm += mused[m]; }
    int mat_changed = nkm != nm;
    if (!sub_changed && !mat_changed) {   /* every submatrix in use, no two equal */
        res = Py_BuildValue("(OOOOOO)", Py_False, Py_False, Py_None, Py_None, Py_None, Py_None);
        goto done;
    }
    /* nothing can fail the Python form's way from here on: the commands are edited */
    PyObject *new_subs = PyList_New(next), *used_l = PyList_New(nm), *source = PyList_New(next);
    PyObject *o2n_l = PyList_New(ns);
    if (!new_subs || !used_l || !source || !o2n_l) goto build_fail;
    PyObject *s0 = PyList_GET_ITEM(subs, 0);
    Py_INCREF(s0);
    PyList_SET_ITEM(new_subs, 0, s0);
    PyList_SET_ITEM(source, 0, PyLong_FromLong(0));
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (rep[i] != i) continue;
        int s = kept[i], nn = newnum[i];
        PyObject *info;
        int m = ext[5 * s];
        if (newmat[m] == m) {
            info = PyList_GET_ITEM(subs, s);
            Py_INCREF(info);
        } else {
            int v[5] = {newmat[m], ext[5 * s + 1], ext[5 * s + 2], ext[5 * s + 3], ext[5 * s + 4]};
            info = ints_tuple(subinfo_type, v, 5);
            if (!info) goto build_fail;
        }
        PyList_SET_ITEM(new_subs, nn, info);
        PyObject *src = PyLong_FromLong(s);
        if (!src) goto build_fail;
        PyList_SET_ITEM(source, nn, src);
    }
    for (Py_ssize_t m = 0; m < nm; m++) {
        PyObject *b = mused[m] ? Py_True : Py_False;
        Py_INCREF(b);
        PyList_SET_ITEM(used_l, m, b);
    }
    for (Py_ssize_t s = 0; s < ns; s++) {
        PyObject *v = PyLong_FromLong(s == 0 ? 0 : (refd[s] ? o2n[s] : -1));
        if (!v) goto build_fail;
        PyList_SET_ITEM(o2n_l, s, v);
    }
    if (sub_changed) {
        for (Py_ssize_t i = 0; i < slots.n; i += 3) {
            int c = slots.d[i], slot = slots.d[i + 1], v = slots.d[i + 2];
            if (o2n[v] != v && store_attr(PyList_GET_ITEM(commands, c), 2 + slot,
                                          PyLong_FromLong(o2n[v])))
                goto build_fail;
        }
    }
    res = Py_BuildValue("(OONNNN)", sub_changed ? Py_True : Py_False,
                        mat_changed ? Py_True : Py_False, new_subs, used_l, source, o2n_l);
    goto done;
build_fail:
    Py_XDECREF(new_subs); Py_XDECREF(used_l); Py_XDECREF(source); Py_XDECREF(o2n_l);
done:
    free(refd); free(ext); free(key); free(kept); free(newnum); free(rep); free(o2n);
    free(newmat); free(mused); free(ep); free(slots.d);
    if (fallback && !PyErr_Occurred()) { Py_XDECREF(res); Py_RETURN_NONE; }
    return res;
}

static PyObject *py_configure_renumber(PyObject *self, PyObject *args) {
    PyObject *plans;
    PyTypeObject *type;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &plans, &PyType_Type, &type)) return NULL;
    if (PyTuple_GET_SIZE(plans) != NUM_TYPES || !PyType_IsSubtype(type, &PyTuple_Type)
            || type->tp_itemsize != sizeof(PyObject *)) {
        PyErr_SetString(PyExc_ValueError, "configure_renumber: bad arguments");
        return NULL;
    }
    for (int t = 0; t < NUM_TYPES; t++) {
        PyObject *sl = PyTuple_GET_ITEM(plans, t);
        if (!PyTuple_Check(sl) || PyTuple_GET_SIZE(sl) > 7) {
            PyErr_SetString(PyExc_ValueError, "configure_renumber: bad slots");
            return NULL;
        }
        rn_n[t] = (int)PyTuple_GET_SIZE(sl);
        for (int k = 0; k < rn_n[t]; k++) {
            long v = PyLong_AsLong(PyTuple_GET_ITEM(sl, k));
            if (v < 0 || v >= 7) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad slot");
                return NULL;
            }
            rn_slot[t][k] = (int)v;
        }
    }
    Py_INCREF(type);
    Py_XSETREF(subinfo_type, type);
    rn_configured = 1;
    Py_RETURN_NONE;
}

static PyObject *py_configure_command(PyObject *self, PyObject *args) {
    PyTypeObject *type;
    if (!PyArg_ParseTuple(args, "O!", &PyType_Type, &type)) return NULL;
    for (int i = 0; i < 9; i++) {
        PyObject *d = PyObject_GetAttr((PyObject *)type, attr_names[i]);
        if (!d) return NULL;
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type)
            && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        if (ok) slot_offsets[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!ok) Py_RETURN_FALSE;   /* not slots: every read goes through getattr */
    }
    Py_INCREF(type);
    Py_XSETREF(cmd_type, type);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"merge", py_merge, METH_VARARGS,
     "merge(commands, submatrices, matrices, props, accesses_of, options, by_number)"},
    {"configure", py_configure, METH_VARARGS, "configure(plans, property_bits, no_operation)"},
    {"renumber_submatrices", py_renumber_submatrices, METH_VARARGS,
     "renumber_submatrices(commands, submatrices, num_matrices, indexes_multi, order_key)"},
    {"configure_renumber", py_configure_renumber, METH_VARARGS,
     "configure_renumber(submatrix_slots, SubMatrixInfo)"},
    {"configure_command", py_configure_command, METH_VARARGS,
     "configure_command(Command): read its slots directly"},
    {"convert_addition", py_convert_addition, METH_VARARGS,
     "convert_addition(commands, submatrices, num_matrices, indexes_multi)"},
    {"configure_convert", py_configure_convert, METH_VARARGS, "configure_convert(plans)"},
    {"move_sizing_commands", py_move_sizing, METH_VARARGS,
     "move_sizing_commands(commands, submatrices, num_matrices, indexes_multi)"},
    {"allocation_pairs", py_allocation_pairs, METH_VARARGS,
     "allocation_pairs(commands, submatrices, matrices, default_stride)"},
    {"extend_matrices", py_extend_matrices, METH_VARARGS,
     "extend_matrices(commands, submatrices, matrices, min_proportion)"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "Optimizer passes in C.", -1, methods,
    NULL, NULL, NULL, NULL
};

PyMODINIT_FUNC PyInit__native(void) {
    s_type = PyUnicode_InternFromString("command_type");
    s_alpha = PyUnicode_InternFromString("alpha");
    char name[8];
    for (int i = 0; i < 7; i++) {
        snprintf(name, sizeof(name), "arg%d", i + 1);
        s_args[i] = PyUnicode_InternFromString(name);
        if (!s_args[i]) return NULL;
    }
    if (!s_type || !s_alpha) return NULL;
    attr_names[0] = s_type;
    attr_names[1] = s_alpha;
    for (int i = 0; i < 7; i++) attr_names[2 + i] = s_args[i];
    return PyModule_Create(&module);
}
