/*
 * A fake NVML (libnvidia-ml.so.1) for testing the real pynvml path without a GPU.
 *
 * Rules:
 * - Built by the tests: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1.
 *   Loaded (RTLD_GLOBAL) before pynvml's nvmlInit, so pynvml's
 *   CDLL("libnvidia-ml.so.1") finds this library by its soname.
 * - nvmlInitWithFlags reads the node from the file named by $FAKE_NVML_CONFIG
 *   (written by the tests from a host file), one record per line, fields
 *   separated by single tabs:
 *     driver <version>
 *     gpu    <minor> <mem total B> <mem used B> <util gpu %> <util mem %>
 *            <power mW|-1> <temp C|-1> <numa|-1> <mig 0|1> <bus id> <uuid> <name>
 *     link   <gpu index> <peer gpu index>     (one line per link, in link order)
 *     topo   <gpu index> <gpu index> <level>  (a pair not listed: NOT_SUPPORTED)
 *     events <gpu index> <mask>               (nvmlDeviceGetSupportedEventTypes;
 *                                              default: Xid | double-bit ECC)
 *     mig    <gpu index> <gi> <ci> <GI profile slot> <GI profile id>
 *            <GI slices> <CI slices> <mem total B> <mem used B> <uuid>
 *            <GI profile name, e.g. "MIG 1g.18gb">   (one MIG device, in
 *            MIG index order per GPU; see the MIG section at the end)
 *   -1 marks a reading the GPU cannot give (NVML_ERROR_NOT_SUPPORTED).
 * - Health events: the file named by $FAKE_NVML_EVENTS (read when an event
 *   set is created; the test appends to it while the library runs), one
 *   record per line, fields separated by single tabs:
 *     xid    <gpu index> <xid> [gi]   (nvmlEventTypeXidCriticalError; on one MIG
 *                                     GPU instance when gi is given)
 *     ecc    <gpu index> [gi]         (nvmlEventTypeDoubleBitEccError)
 *     error  <nvml return code> <n>   (this wait and the next n-1 fail with it)
 *   Each event set reads the lines appended after it was created (events
 *   raised before a set existed never reach it, as with NVML), only whole
 *   lines, and delivers an event only for a GPU and type registered on it.
 *   nvmlEventSetWait_v2 polls the file every millisecond until its timeout,
 *   then answers NVML_ERROR_TIMEOUT. nvmlDeviceRegisterEvents refuses a
 *   type the GPU does not support with NVML_ERROR_NOT_SUPPORTED (registering
 *   nothing), as NVML does.
 * - Error injection: $FAKE_NVML_FAIL is a comma list of function=code
 *   (e.g. "nvmlInitWithFlags=9" for NVML_ERROR_DRIVER_NOT_LOADED,
 *   "nvmlDeviceGetMinorNumber=3" for NVML_ERROR_NOT_SUPPORTED); it is read
 *   on every call, so a test may change it between calls.
 * - Like NVML: calls before init fail with NVML_ERROR_UNINITIALIZED, a bad
 *   handle or index with NVML_ERROR_INVALID_ARGUMENT, a short buffer with
 *   NVML_ERROR_INSUFFICIENT_SIZE. Init is reference counted; each first init
 *   re-reads the config, so one process can serve several host files.
 * - NVLink: links 0..17 exist on a GPU with any link (inactive when not
 *   listed); links >= 18 are NVML_ERROR_INVALID_ARGUMENT; a GPU with no
 *   links answers NVML_ERROR_NOT_SUPPORTED.
 * - Compute mode (nvmlDeviceGetComputeMode / nvmlDeviceSetComputeMode; 0
 *   DEFAULT, 2 PROHIBITED, 3 EXCLUSIVE_PROCESS; 1, the old EXCLUSIVE_THREAD,
 *   and anything past 3 are NVML_ERROR_INVALID_ARGUMENT when set): a GPU
 *   starts in the mode of its config line "compute <gpu index> <mode>"
 *   (DEFAULT without one). The mode is the driver's state, not the
 *   process's: when $FAKE_NVML_STATE names a file, every set appends
 *   "compute <uuid> <mode>" to it and every get answers the last such line
 *   for the GPU, so a mode outlives nvmlShutdown and the process that set
 *   it, other processes see it, and the file is the history of every
 *   change (tests read it). Without the variable the mode lives in this
 *   process until the config is read again. A MIG device handle is
 *   NVML_ERROR_INVALID_ARGUMENT, as for every other per-GPU call here.
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 1024
#define MAX_LINKS 18
#define MAX_EVENT_SETS 16

#define EVENT_ECC 0x2ULL
#define EVENT_XID 0x8ULL

typedef int nvmlReturn_t;

struct fake_device {
    unsigned int index;
    unsigned int minor;
    unsigned long long mem_total, mem_used;
    int util_gpu, util_mem, power_mw, temp_c, numa, mig;
    int compute_mode; /* nvmlComputeMode_t, see the rules */
    char bus_id[32];
    char uuid[96];
    char name[96];
    int links[MAX_LINKS]; /* peer index per link */
    int link_count;
    unsigned long long supported; /* nvmlDeviceGetSupportedEventTypes */
};

typedef struct fake_device *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct fake_event_set {
    int in_use;
    long offset;                          /* next byte of $FAKE_NVML_EVENTS to read */
    unsigned long long registered[MAX_GPUS];
    nvmlReturn_t fail_code;               /* from an "error" line */
    unsigned long fail_left;
};

typedef struct fake_event_set *nvmlEventSet_t;

static struct fake_device devices[MAX_GPUS];
static unsigned int device_count;
static signed char *topology; /* device_count * device_count levels, -1 unknown */
static char driver_version[80] = "0.0";
static int init_count;
static struct fake_event_set event_sets[MAX_EVENT_SETS];

/* MIG: defined in the MIG section at the end of this file. */
static void mig_reset(void);
static void mig_load(char **cursor);
static int is_mig(nvmlDevice_t device);
static nvmlReturn_t mig_uuid(nvmlDevice_t device, char *uuid, unsigned int length);
static nvmlReturn_t mig_memory(nvmlDevice_t device, void *memory);
static nvmlReturn_t mig_whole_gpu_only(const char *function, nvmlDevice_t device);

static nvmlReturn_t injected(const char *function)
{
    const char *spec = getenv("FAKE_NVML_FAIL");
    size_t length = strlen(function);
    while (spec != NULL && *spec != '\0') {
        if (strncmp(spec, function, length) == 0 && spec[length] == '=') {
            return (nvmlReturn_t)atoi(spec + length + 1);
        }
        spec = strchr(spec, ',');
        if (spec != NULL) {
            spec++;
        }
    }
    return NVML_SUCCESS;
}

#define ENTER(name)                                  \
    do {                                             \
        nvmlReturn_t _injected = injected(name);     \
        if (_injected != NVML_SUCCESS) {             \
            return _injected;                        \
        }                                            \
        if (init_count <= 0) {                       \
            return NVML_ERROR_UNINITIALIZED;         \
        }                                            \
    } while (0)

static int valid(nvmlDevice_t device)
{
    return device >= devices && device < devices + device_count;
}

#define ENTER_DEVICE(name, device)                   \
    do {                                             \
        ENTER(name);                                 \
        if (!valid(device)) {                        \
            return NVML_ERROR_INVALID_ARGUMENT;      \
        }                                            \
    } while (0)

static char *field(char **cursor)
{
    char *start = *cursor;
    char *tab;
    if (start == NULL) {
        return (char *)""; /* a missing field reads as empty */
    }
    tab = strchr(start, '\t');
    if (tab != NULL) {
        *tab = '\0';
        *cursor = tab + 1;
    } else {
        *cursor = NULL;
    }
    return start;
}

static void copy_text(char *target, size_t size, const char *source)
{
    snprintf(target, size, "%s", source != NULL ? source : "");
}

static nvmlReturn_t load_config(void)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *file;
    char line[1024];
    device_count = 0;
    mig_reset();
    free(topology);
    topology = NULL;
    copy_text(driver_version, sizeof driver_version, "0.0");
    if (path == NULL) {
        return NVML_SUCCESS; /* a node without GPUs */
    }
    file = fopen(path, "r");
    if (file == NULL) {
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    /* First pass: GPUs; second pass: links, topology and supported events. */
    for (int pass = 0; pass < 2; pass++) {
        rewind(file);
        while (fgets(line, sizeof line, file) != NULL) {
            char *cursor = line;
            char *kind;
            line[strcspn(line, "\n")] = '\0';
            kind = field(&cursor);
            if (kind[0] == '\0') {
                continue;
            }
            if (pass == 0 && strcmp(kind, "driver") == 0) {
                copy_text(driver_version, sizeof driver_version, field(&cursor));
            } else if (pass == 0 && strcmp(kind, "gpu") == 0 && device_count < MAX_GPUS) {
                struct fake_device *d = &devices[device_count];
                memset(d, 0, sizeof *d);
                d->index = device_count;
                d->supported = EVENT_XID | EVENT_ECC;
                d->minor = (unsigned int)strtoul(field(&cursor), NULL, 10);
                d->mem_total = strtoull(field(&cursor), NULL, 10);
                d->mem_used = strtoull(field(&cursor), NULL, 10);
                d->util_gpu = atoi(field(&cursor));
                d->util_mem = atoi(field(&cursor));
                d->power_mw = atoi(field(&cursor));
                d->temp_c = atoi(field(&cursor));
                d->numa = atoi(field(&cursor));
                d->mig = atoi(field(&cursor));
                copy_text(d->bus_id, sizeof d->bus_id, field(&cursor));
                copy_text(d->uuid, sizeof d->uuid, field(&cursor));
                copy_text(d->name, sizeof d->name, field(&cursor));
                device_count++;
            } else if (pass == 1 && strcmp(kind, "link") == 0) {
                unsigned int index = (unsigned int)atoi(field(&cursor));
                int peer = atoi(field(&cursor));
                if (index < device_count && devices[index].link_count < MAX_LINKS) {
                    devices[index].links[devices[index].link_count++] = peer;
                }
            } else if (pass == 1 && strcmp(kind, "topo") == 0) {
                unsigned int a = (unsigned int)atoi(field(&cursor));
                unsigned int b = (unsigned int)atoi(field(&cursor));
                int level = atoi(field(&cursor));
                if (topology == NULL) {
                    topology = malloc((size_t)device_count * device_count + 1);
                    memset(topology, -1, (size_t)device_count * device_count + 1);
                }
                if (a < device_count && b < device_count) {
                    topology[a * device_count + b] = (signed char)level;
                    topology[b * device_count + a] = (signed char)level;
                }
            } else if (pass == 1 && strcmp(kind, "mig") == 0) {
                mig_load(&cursor);
            } else if (pass == 1 && strcmp(kind, "compute") == 0) {
                unsigned int index = (unsigned int)atoi(field(&cursor));
                int mode = atoi(field(&cursor));
                if (index < device_count) {
                    devices[index].compute_mode = mode;
                }
            } else if (pass == 1 && strcmp(kind, "events") == 0) {
                unsigned int index = (unsigned int)atoi(field(&cursor));
                unsigned long long mask = strtoull(field(&cursor), NULL, 0);
                if (index < device_count) {
                    devices[index].supported = mask;
                }
            }
        }
    }
    fclose(file);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------ init */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    nvmlReturn_t injected_code = injected("nvmlInitWithFlags");
    (void)flags;
    if (injected_code != NVML_SUCCESS) {
        return injected_code;
    }
    if (init_count == 0) {
        nvmlReturn_t loaded = load_config();
        if (loaded != NVML_SUCCESS) {
            return loaded;
        }
    }
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    ENTER("nvmlShutdown");
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error";
    }
}

/* ------------------------------------------------------------ system */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetDriverVersion");
    if (version == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (strlen(driver_version) + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    copy_text(version, length, driver_version);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------ devices */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    ENTER("nvmlDeviceGetCount_v2");
    if (count == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *count = device_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByIndex_v2");
    if (device == NULL || index >= device_count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    ENTER_DEVICE("nvmlDeviceGetIndex", device);
    *index = device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    ENTER_DEVICE("nvmlDeviceGetMinorNumber", device);
    if (minor == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *minor = device->minor;
    return NVML_SUCCESS;
}

static nvmlReturn_t give_text(char *target, unsigned int length, const char *text)
{
    if (target == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (strlen(text) + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    copy_text(target, length, text);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    if (is_mig(device)) {
        return mig_uuid(device, uuid, length);
    }
    ENTER_DEVICE("nvmlDeviceGetUUID", device);
    return give_text(uuid, length, device->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER_DEVICE("nvmlDeviceGetName", device);
    return give_text(name, length, device->name);
}

static void fill_pci(const struct fake_device *device, nvmlPciInfo_t *pci)
{
    unsigned int domain = 0, bus = 0, slot = 0, function = 0;
    memset(pci, 0, sizeof *pci);
    sscanf(device->bus_id, "%x:%x:%x.%x", &domain, &bus, &slot, &function);
    copy_text(pci->busId, sizeof pci->busId, device->bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xFFFF, bus, slot, function);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = slot;
    pci->pciDeviceId = 0x20B010DE;
    pci->pciSubSystemId = 0x134F10DE;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER_DEVICE("nvmlDeviceGetPciInfo_v3", device);
    if (pci == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    fill_pci(device, pci);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (is_mig(device)) {
        return mig_memory(device, memory);
    }
    ENTER_DEVICE("nvmlDeviceGetMemoryInfo", device);
    if (memory == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    memory->total = device->mem_total;
    memory->used = device->mem_used;
    memory->free = device->mem_total - device->mem_used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *rates)
{
    if (is_mig(device)) {
        return mig_whole_gpu_only("nvmlDeviceGetUtilizationRates", device);
    }
    ENTER_DEVICE("nvmlDeviceGetUtilizationRates", device);
    if (rates == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    rates->gpu = (unsigned int)device->util_gpu;
    rates->memory = (unsigned int)device->util_mem;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    if (is_mig(device)) {
        return mig_whole_gpu_only("nvmlDeviceGetPowerUsage", device);
    }
    ENTER_DEVICE("nvmlDeviceGetPowerUsage", device);
    if (device->power_mw < 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *power = (unsigned int)device->power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temperature)
{
    if (is_mig(device)) {
        return mig_whole_gpu_only("nvmlDeviceGetTemperature", device);
    }
    ENTER_DEVICE("nvmlDeviceGetTemperature", device);
    if (sensor != 0) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (device->temp_c < 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *temperature = (unsigned int)device->temp_c;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    ENTER_DEVICE("nvmlDeviceGetNumaNodeId", device);
    if (device->numa < 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *node = (unsigned int)device->numa;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    ENTER_DEVICE("nvmlDeviceGetMigMode", device);
    *current = (unsigned int)device->mig;
    *pending = (unsigned int)device->mig;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------ compute mode */

#define COMPUTE_DEFAULT 0
#define COMPUTE_PROHIBITED 2
#define COMPUTE_EXCLUSIVE_PROCESS 3

/* The last mode $FAKE_NVML_STATE records for the GPU, or its own (see rules). */
static int state_compute_mode(const struct fake_device *device)
{
    const char *path = getenv("FAKE_NVML_STATE");
    FILE *file;
    char line[256];
    int mode = device->compute_mode;
    if (path == NULL || *path == '\0') {
        return mode;
    }
    file = fopen(path, "r");
    if (file == NULL) {
        return mode; /* nothing set yet */
    }
    while (fgets(line, sizeof line, file) != NULL) {
        char *cursor = line;
        line[strcspn(line, "\n")] = '\0';
        if (strcmp(field(&cursor), "compute") == 0 && strcmp(field(&cursor), device->uuid) == 0) {
            mode = atoi(field(&cursor));
        }
    }
    fclose(file);
    return mode;
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode)
{
    ENTER_DEVICE("nvmlDeviceGetComputeMode", device);
    if (mode == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *mode = state_compute_mode(device);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, int mode)
{
    const char *path = getenv("FAKE_NVML_STATE");
    ENTER_DEVICE("nvmlDeviceSetComputeMode", device);
    if (mode != COMPUTE_DEFAULT && mode != COMPUTE_PROHIBITED && mode != COMPUTE_EXCLUSIVE_PROCESS) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (path != NULL && *path != '\0') {
        FILE *file = fopen(path, "a");
        if (file == NULL) {
            return NVML_ERROR_NO_PERMISSION;
        }
        fprintf(file, "compute\t%s\t%d\n", device->uuid, mode);
        fclose(file);
    }
    device->compute_mode = mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *active)
{
    ENTER_DEVICE("nvmlDeviceGetNvLinkState", device);
    if (device->link_count == 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    if (link >= MAX_LINKS) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *active = (int)link < device->link_count ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    int peer;
    ENTER_DEVICE("nvmlDeviceGetNvLinkRemotePciInfo_v2", device);
    if (device->link_count == 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    if ((int)link >= device->link_count || pci == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    peer = device->links[link];
    if (peer < 0 || (unsigned int)peer >= device_count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    fill_pci(&devices[peer], pci);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t first, nvmlDevice_t second, int *level)
{
    signed char value;
    ENTER("nvmlDeviceGetTopologyCommonAncestor");
    if (!valid(first) || !valid(second) || level == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (first == second) {
        *level = 0;
        return NVML_SUCCESS;
    }
    if (topology == NULL) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    value = topology[first->index * device_count + second->index];
    if (value < 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *level = value;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------ events */

static int valid_set(nvmlEventSet_t set)
{
    return set >= event_sets && set < event_sets + MAX_EVENT_SETS && set->in_use;
}

static long events_file_size(void)
{
    const char *path = getenv("FAKE_NVML_EVENTS");
    FILE *file;
    long size = 0;
    if (path == NULL || (file = fopen(path, "r")) == NULL) {
        return 0;
    }
    if (fseek(file, 0, SEEK_END) == 0) {
        size = ftell(file);
    }
    fclose(file);
    return size < 0 ? 0 : size;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    ENTER("nvmlEventSetCreate");
    if (set == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!event_sets[i].in_use) {
            memset(&event_sets[i], 0, sizeof event_sets[i]);
            event_sets[i].in_use = 1;
            event_sets[i].offset = events_file_size(); /* earlier events never reach it */
            *set = &event_sets[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types)
{
    ENTER_DEVICE("nvmlDeviceGetSupportedEventTypes", device);
    if (types == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *types = device->supported;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set)
{
    ENTER_DEVICE("nvmlDeviceRegisterEvents", device);
    if (!valid_set(set)) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if ((types & ~device->supported) != 0) {
        return NVML_ERROR_NOT_SUPPORTED; /* NVML registers nothing then */
    }
    set->registered[device->index] |= types;
    return NVML_SUCCESS;
}

/* The next whole line of the events file for ``set``: 1 and the line, or 0. */
static int next_line(nvmlEventSet_t set, char *line, size_t size)
{
    const char *path = getenv("FAKE_NVML_EVENTS");
    FILE *file;
    int found = 0;
    if (path == NULL || (file = fopen(path, "r")) == NULL) {
        return 0;
    }
    if (fseek(file, set->offset, SEEK_SET) == 0 && fgets(line, (int)size, file) != NULL) {
        size_t length = strlen(line);
        if (length > 0 && line[length - 1] == '\n') { /* a line still being written waits */
            set->offset += (long)length;
            line[length - 1] = '\0';
            found = 1;
        }
    }
    fclose(file);
    return found;
}

/* Apply one line of the events file; 1 when it yields an event for ``set``. */
static int take_event(nvmlEventSet_t set, char *line, nvmlEventData_t *data)
{
    char *cursor = line;
    const char *kind = field(&cursor);
    unsigned long long type;
    unsigned int index;
    unsigned long long code = 0;
    const char *instance;
    if (strcmp(kind, "error") == 0) {
        set->fail_code = (nvmlReturn_t)atoi(field(&cursor));
        set->fail_left = strtoul(field(&cursor), NULL, 10);
        return 0;
    }
    if (strcmp(kind, "xid") == 0) {
        type = EVENT_XID;
    } else if (strcmp(kind, "ecc") == 0) {
        type = EVENT_ECC;
    } else {
        return 0;
    }
    index = (unsigned int)atoi(field(&cursor));
    if (type == EVENT_XID) {
        code = strtoull(field(&cursor), NULL, 10);
    }
    instance = field(&cursor);
    if (index >= device_count || (set->registered[index] & type) == 0) {
        return 0; /* not registered on this set: NVML would not deliver it */
    }
    memset(data, 0, sizeof *data);
    data->device = &devices[index];
    data->eventType = type;
    data->eventData = code;
    data->gpuInstanceId = instance[0] != '\0' ? (unsigned int)strtoul(instance, NULL, 10) : 0xFFFFFFFFu;
    data->computeInstanceId = 0xFFFFFFFFu;
    return 1;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    char line[256];
    struct timespec start, now;
    ENTER("nvmlEventSetWait_v2");
    if (!valid_set(set) || data == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        while (set->fail_left == 0 && next_line(set, line, sizeof line)) {
            if (take_event(set, line, data)) {
                return NVML_SUCCESS;
            }
        }
        if (set->fail_left > 0) {
            set->fail_left--;
            return set->fail_code;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000.0 + (now.tv_nsec - start.tv_nsec) / 1e6 >= timeout_ms) {
            return NVML_ERROR_TIMEOUT;
        }
        usleep(1000);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    ENTER("nvmlEventSetFree");
    if (!valid_set(set)) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    set->in_use = 0;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------ MIG
 *
 * MIG devices of the GPUs with MIG mode on, from the config's "mig" lines.
 * A MIG device handle points into migs[]; it answers the MIG calls below,
 * nvmlDeviceGetUUID and nvmlDeviceGetMemoryInfo; utilization, power and
 * temperature answer NVML_ERROR_NOT_SUPPORTED, and every other per-GPU call
 * NVML_ERROR_INVALID_ARGUMENT (it is not a GPU handle). A GPU with MIG mode
 * on has MAX_MIG_SLOTS slots; a slot without a MIG device answers
 * NVML_ERROR_NOT_FOUND. A GPU instance handle is the handle of its first
 * MIG device. GPU instance profiles are the config's slots and ids.
 */

#define MAX_MIGS (MAX_GPUS * 7)
#define MAX_MIG_SLOTS 7
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define GI_PROFILE_INFO_V2 0x02000098u
#define GI_PROFILE_COUNT 0x12u

struct fake_mig {
    struct fake_device *parent;
    unsigned int index; /* MIG device index on its parent */
    unsigned int gi, ci;
    unsigned int gi_profile_slot, gi_profile_id;
    unsigned int gi_slices, ci_slices;
    unsigned long long mem_total, mem_used;
    char uuid[96];
    char gi_profile_name[96];
};

typedef struct fake_mig *nvmlGpuInstance_t;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlGpuInstancePlacement_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;

static struct fake_mig migs[MAX_MIGS];
static unsigned int mig_count;

static void mig_reset(void)
{
    mig_count = 0;
}

static void mig_load(char **cursor)
{
    unsigned int parent = (unsigned int)atoi(field(cursor));
    struct fake_mig *m;
    unsigned int index = 0;
    if (parent >= device_count || mig_count >= MAX_MIGS) {
        return;
    }
    for (unsigned int i = 0; i < mig_count; i++) {
        if (migs[i].parent == &devices[parent]) {
            index++;
        }
    }
    m = &migs[mig_count++];
    memset(m, 0, sizeof *m);
    m->parent = &devices[parent];
    m->index = index;
    m->gi = (unsigned int)strtoul(field(cursor), NULL, 10);
    m->ci = (unsigned int)strtoul(field(cursor), NULL, 10);
    m->gi_profile_slot = (unsigned int)strtoul(field(cursor), NULL, 10);
    m->gi_profile_id = (unsigned int)strtoul(field(cursor), NULL, 10);
    m->gi_slices = (unsigned int)strtoul(field(cursor), NULL, 10);
    m->ci_slices = (unsigned int)strtoul(field(cursor), NULL, 10);
    m->mem_total = strtoull(field(cursor), NULL, 10);
    m->mem_used = strtoull(field(cursor), NULL, 10);
    copy_text(m->uuid, sizeof m->uuid, field(cursor));
    copy_text(m->gi_profile_name, sizeof m->gi_profile_name, field(cursor));
}

static struct fake_mig *as_mig(const void *handle)
{
    const char *p = (const char *)handle;
    const char *first = (const char *)migs;
    if (p < first || p >= (const char *)(migs + mig_count) || (size_t)(p - first) % sizeof(struct fake_mig) != 0) {
        return NULL;
    }
    return (struct fake_mig *)handle;
}

static int is_mig(nvmlDevice_t device)
{
    return as_mig(device) != NULL;
}

#define ENTER_MIG(name, handle, mig)                 \
    do {                                             \
        ENTER(name);                                 \
        (mig) = as_mig(handle);                      \
        if ((mig) == NULL) {                         \
            return NVML_ERROR_INVALID_ARGUMENT;      \
        }                                            \
    } while (0)

static nvmlReturn_t mig_uuid(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct fake_mig *m;
    ENTER_MIG("nvmlDeviceGetUUID", device, m);
    return give_text(uuid, length, m->uuid);
}

static nvmlReturn_t mig_memory(nvmlDevice_t device, void *out)
{
    struct fake_mig *m;
    nvmlMemory_t *memory = out;
    ENTER_MIG("nvmlDeviceGetMemoryInfo", device, m);
    if (memory == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    memory->total = m->mem_total;
    memory->used = m->mem_used;
    memory->free = m->mem_total - m->mem_used;
    return NVML_SUCCESS;
}

static nvmlReturn_t mig_whole_gpu_only(const char *function, nvmlDevice_t device)
{
    struct fake_mig *m;
    ENTER_MIG(function, device, m);
    (void)m;
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    ENTER_DEVICE("nvmlDeviceGetMaxMigDeviceCount", device);
    if (count == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!device->mig) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *count = MAX_MIG_SLOTS;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig)
{
    ENTER_DEVICE("nvmlDeviceGetMigDeviceHandleByIndex", device);
    if (mig == NULL || index >= MAX_MIG_SLOTS) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!device->mig) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    for (unsigned int i = 0; i < mig_count; i++) {
        if (migs[i].parent == device && migs[i].index == index) {
            *mig = (nvmlDevice_t)(void *)&migs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig_device)
{
    ENTER("nvmlDeviceIsMigDeviceHandle");
    if (is_mig_device == NULL || (!is_mig(device) && !valid(device))) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *is_mig_device = (unsigned int)is_mig(device);
    return NVML_SUCCESS;
}

/* An NVML getter of one field of a MIG device handle. */
#define MIG_FIELD_GETTER(function, type, field)                  \
    nvmlReturn_t function(nvmlDevice_t device, type *out)        \
    {                                                            \
        struct fake_mig *m;                                      \
        ENTER_MIG(#function, device, m);                         \
        if (out == NULL) {                                       \
            return NVML_ERROR_INVALID_ARGUMENT;                  \
        }                                                        \
        *out = m->field;                                         \
        return NVML_SUCCESS;                                     \
    }

MIG_FIELD_GETTER(nvmlDeviceGetGpuInstanceId, unsigned int, gi)
MIG_FIELD_GETTER(nvmlDeviceGetComputeInstanceId, unsigned int, ci)
MIG_FIELD_GETTER(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, nvmlDevice_t, parent)

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    struct fake_mig *m;
    ENTER("nvmlDeviceGetAttributes_v2");
    if (attributes == NULL || (!is_mig(device) && !valid(device))) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    m = as_mig(device);
    if (m == NULL) {
        return NVML_ERROR_NOT_SUPPORTED; /* whole-GPU attributes are not served */
    }
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = 16 * m->ci_slices;
    attributes->sharedCopyEngineCount = m->gi_slices;
    attributes->gpuInstanceSliceCount = m->gi_slices;
    attributes->computeInstanceSliceCount = m->ci_slices;
    attributes->memorySizeMB = m->mem_total / (1024ULL * 1024ULL);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *instance)
{
    ENTER_DEVICE("nvmlDeviceGetGpuInstanceById", device);
    if (instance == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!device->mig) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    for (unsigned int i = 0; i < mig_count; i++) {
        if (migs[i].parent == device && migs[i].gi == id) {
            *instance = &migs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t instance, nvmlGpuInstanceInfo_t *info)
{
    struct fake_mig *m;
    ENTER_MIG("nvmlGpuInstanceGetInfo", instance, m);
    if (info == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    memset(info, 0, sizeof *info);
    info->device = m->parent;
    info->id = m->gi;
    info->profileId = m->gi_profile_id;
    info->placement.start = 0;
    info->placement.size = m->gi_slices;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info)
{
    ENTER_DEVICE("nvmlDeviceGetGpuInstanceProfileInfoV", device);
    if (info == NULL || profile >= GI_PROFILE_COUNT) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (info->version != GI_PROFILE_INFO_V2) {
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    if (!device->mig) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    for (unsigned int i = 0; i < mig_count; i++) {
        const struct fake_mig *m = &migs[i];
        if (m->parent == device && m->gi_profile_slot == profile) {
            unsigned int version = info->version;
            memset(info, 0, sizeof *info);
            info->version = version;
            info->id = m->gi_profile_id;
            info->sliceCount = m->gi_slices;
            info->instanceCount = m->gi_slices > 0 ? MAX_MIG_SLOTS / m->gi_slices : 0;
            info->multiprocessorCount = 16 * m->gi_slices;
            info->copyEngineCount = m->gi_slices;
            info->memorySizeMB = m->mem_total / (1024ULL * 1024ULL);
            copy_text(info->name, sizeof info->name, m->gi_profile_name);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_SUPPORTED; /* a profile no MIG device of this GPU uses */
}
