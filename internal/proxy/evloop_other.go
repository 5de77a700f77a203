//go:build !linux

package proxy

import (
	"errors"
	"net"
	"time"

	"go.uber.org/zap"
)

var errNoLoops = errors.New("the relay's event loop runs on Linux only")

type eventLoops struct{}

type eventLoop struct{}

func newEventLoops(int, *zap.Logger) (*eventLoops, error) { return nil, errNoLoops }

func (*eventLoops) pick() *eventLoop        { return nil }
func (*eventLoops) close()                  {}
func (*eventLoop) add(*laneStream) bool     { return false }
func (*eventLoop) cancel(*laneStream)       {}
func dupFD(c net.Conn) (int, func(), error) { c.Close(); return -1, func() {}, errNoLoops }
func fdConn(int) (net.Conn, error)          { return nil, errNoLoops }
func closeFD(int)                           {}

func writeFD(int, []byte, time.Duration) error { return errNoLoops }
func idleAlive(int) bool                       { return false }
