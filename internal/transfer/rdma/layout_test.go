package rdma

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// headerProbe prints, from UCX's own headers, what vhi_layout reports
// from the mirrors in ucx.go, in the same order.
const headerProbe = `#include <stdio.h>
#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>
int main(void) {
	uint64_t o[] = {
		offsetof(ucp_params_t, features),
		offsetof(ucp_worker_params_t, thread_mode),
		offsetof(ucp_ep_params_t, address),
		offsetof(ucp_ep_params_t, err_mode),
		offsetof(ucp_ep_params_t, err_handler) + offsetof(ucp_err_handler_t, cb),
		offsetof(ucp_ep_params_t, err_handler) + offsetof(ucp_err_handler_t, arg),
		offsetof(ucp_mem_map_params_t, address),
		offsetof(ucp_mem_map_params_t, length),
		offsetof(ucp_request_param_t, flags),
		UCP_PARAM_FIELD_FEATURES,
		UCP_FEATURE_RMA,
		UCP_WORKER_PARAM_FIELD_THREAD_MODE,
		UCS_THREAD_MODE_SERIALIZED,
		UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE << 8 | UCP_EP_PARAM_FIELD_ERR_HANDLER << 16,
		UCP_ERR_HANDLING_MODE_PEER,
		UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH << 8,
		UCP_OP_ATTR_FIELD_FLAGS,
		UCP_EP_CLOSE_FLAG_FORCE,
		(uint64_t)(int64_t)UCS_ERR_TIMED_OUT,
		(uint64_t)(int64_t)UCS_ERR_LAST,
	};
	for (size_t i = 0; i < sizeof(o) / sizeof(o[0]); i++) printf("%llu\n", (unsigned long long)o[i]);
	return 0;
}
`

// The mirrors of UCP's parameter structs and constants in ucx.go must
// match UCX's headers where those are installed (CI installs
// libucx-dev): a wrong offset would hand UCX garbage.
func TestStructLayoutMatchesHeaders(t *testing.T) {
	if _, err := os.Stat("/usr/include/ucp/api/ucp.h"); err != nil {
		t.Skip("UCX headers not installed (Debian: libucx-dev)")
	}
	dir := t.TempDir()
	src, bin := filepath.Join(dir, "probe.c"), filepath.Join(dir, "probe")
	if err := os.WriteFile(src, []byte(headerProbe), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cc", "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("compile the probe: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Fields(string(out))
	got := layout()
	if len(want) != len(got) {
		t.Fatalf("the probe printed %d values, the mirrors report %d", len(want), len(got))
	}
	for i, w := range want {
		n, err := strconv.ParseUint(w, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if got[i] != n {
			t.Errorf("value %d: the mirrors say %d, UCX's headers %d", i, got[i], n)
		}
	}
}
