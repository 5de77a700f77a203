package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/host"
)

// hostClientFlags are the flags every operator command shares.
type hostClientFlags struct {
	url    string
	output string
	token  string
}

func (h *hostClientFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&h.url, "host", envDefault("VLLM_HI_HOST_URL", "http://127.0.0.1:8002"), "the Host's URL [VLLM_HI_HOST_URL]")
	cmd.Flags().StringVarP(&h.output, "output", "o", "table", "output: table or json")
	cmd.Flags().StringVar(&h.token, "admin-token-file", "", "file holding the admin token (for mutations)")
}

func (h *hostClientFlags) base() string {
	u := strings.TrimRight(h.url, "/")
	if !strings.Contains(u, "://") {
		u = "http://" + u
	}
	return u
}

// getJSON fetches path from the Host into out, turning the contract's error
// shape into a readable error.
func (h *hostClientFlags) getJSON(path string, out any) error {
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(h.base() + path)
	if err != nil {
		return fmt.Errorf("cannot reach the Host at %s: %w", h.base(), err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("the Host answered %d: %s", resp.StatusCode, hostErrorMessage(b))
	}
	return json.Unmarshal(b, out)
}

func hostErrorMessage(b []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
		return e.Error.Message
	}
	return strings.TrimSpace(string(b))
}

func newInstancesCommand() *cobra.Command {
	var hf hostClientFlags
	cmd := &cobra.Command{
		Use:   "instances",
		Short: "List the instances registered with the Host",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out struct {
				Instances []host.InstanceView `json:"instances"`
			}
			if err := hf.getJSON("/vllm_hi/instances", &out); err != nil {
				return err
			}
			return printInstances(cmd.OutOrStdout(), hf.output, out.Instances)
		},
	}
	hf.add(cmd)
	return cmd
}

func printInstances(w io.Writer, format string, list []host.InstanceView) error {
	switch format {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(map[string]any{"instances": list})
	case "table":
	default:
		return fmt.Errorf("-o %q: want table or json", format)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTYPE\tROLE\tSTATE\tMODEL\tENGINE\tTP\tPP\tMIGRATABLE\tRUNNING\tFREE BLOCKS")
	for _, i := range list {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%v\t%d\t%d/%d\n", i.ID, i.Type, i.Role, i.State,
			i.ServedModelName, i.EngineURL, i.TP, i.PP, i.Migratable, i.Stats.NumRunning, i.Stats.FreeBlocks, i.Stats.TotalBlocks)
	}
	if len(list) == 0 {
		fmt.Fprintln(tw, "(no instances registered)")
	}
	return tw.Flush()
}
