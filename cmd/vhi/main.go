// Command vhi is the single vllm-hi binary: host, agent, sim, demo and the
// operator CLI.
package main

import (
	"os"

	"github.com/vllm-hi/vllm-hi/internal/cli"
)

func main() {
	os.Exit(cli.Execute(os.Args[1:]))
}
